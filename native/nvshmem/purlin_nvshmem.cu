// libpurlin_nvshmem.so: the nvshmem provider's shim (ABI in purlin_nvshmem.h). Host code only.
//
// Why a .cu file compiled with relocatable device code although it has no kernel: NVSHMEM's
// initialisation entry point (nvshmemi_init_thread, which the header's inline nvshmemx_init_attr
// wraps) lives in the wheel's static libnvshmem_device.a next to the device-side state it
// registers, so the library must be device-linked against it (CMake: CUDA_SEPARABLE_COMPILATION
// + CUDA_RESOLVE_DEVICE_SYMBOLS). Everything else is libnvshmem_host.so.3.
//
// The header's inline nvshmemx_init_attr calls exit(-1) when initialisation fails; this shim
// calls nvshmemi_init_thread itself (the same arguments as the inline wrapper) and returns the
// status instead, so a failure becomes a Python exception on every rank, not a dead process.
#include <cuda_runtime.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "nvshmem_host.h"
#include "purlin_nvshmem.h"

#define PURLIN_NVSHMEM_ABI_VERSION 1
#define PURLIN_STR2(x) #x
#define PURLIN_STR(x) PURLIN_STR2(x)
#define PURLIN_NVSHMEM_HEADERS_VERSION                                              \
  PURLIN_STR(NVSHMEM_VENDOR_MAJOR_VERSION) "." PURLIN_STR(NVSHMEM_VENDOR_MINOR_VERSION) "." \
      PURLIN_STR(NVSHMEM_VENDOR_PATCH_VERSION)

namespace {

thread_local char g_error[512];

int fail(int code, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g_error, sizeof(g_error), fmt, ap);
  va_end(ap);
  return code;
}

int ok() {
  g_error[0] = '\0';
  return PURLIN_NVSHMEM_OK;
}

int cuda_fail(const char* call, cudaError_t err) {
  cudaGetLastError();  // clear it: the next CUDA caller in this thread must not see our error
  return fail(PURLIN_NVSHMEM_ERR_CUDA, "%s: %s (%s)", call, cudaGetErrorName(err), cudaGetErrorString(err));
}

// Makes `device` current for one call (its primary context, shared with torch through the driver)
// and gives the caller's current device back afterwards.
class DeviceScope {
 public:
  int enter(int device) {
    if (cudaGetDevice(&prev_) != cudaSuccess) {
      cudaGetLastError();
      prev_ = -1;
    }
    cudaError_t err = cudaSetDevice(device);
    if (err != cudaSuccess) {
      char call[48];
      snprintf(call, sizeof(call), "cudaSetDevice(%d)", device);
      return cuda_fail(call, err);
    }
    device_ = device;
    return PURLIN_NVSHMEM_OK;
  }
  ~DeviceScope() {
    if (prev_ >= 0 && device_ >= 0 && prev_ != device_) cudaSetDevice(prev_);
  }

 private:
  int prev_ = -1;
  int device_ = -1;
};

bool initialised() { return nvshmemx_init_status() >= NVSHMEM_STATUS_IS_INITIALIZED; }

int require_initialised(const char* op) {
  if (!initialised()) return fail(PURLIN_NVSHMEM_ERR_STATE, "%s: NVSHMEM is not initialised in this process", op);
  return PURLIN_NVSHMEM_OK;
}

}  // namespace

PURLIN_NVSHMEM_API int purlin_nvshmem_abi_version(void) { return PURLIN_NVSHMEM_ABI_VERSION; }

PURLIN_NVSHMEM_API const char* purlin_nvshmem_build_info(void) {
  return "{\"abi\": " PURLIN_STR(PURLIN_NVSHMEM_ABI_VERSION) ", \"nvshmem\": \"" PURLIN_NVSHMEM_HEADERS_VERSION "\"}";
}

PURLIN_NVSHMEM_API const char* purlin_nvshmem_last_error(void) { return g_error; }

PURLIN_NVSHMEM_API int purlin_nvshmem_uniqueid_bytes(void) { return (int)sizeof(nvshmemx_uniqueid_t); }

PURLIN_NVSHMEM_API int purlin_nvshmem_runtime_version(int* major, int* minor, int* patch) {
  if (!major || !minor || !patch) return fail(PURLIN_NVSHMEM_ERR_ARGUMENT, "runtime_version: null output");
  nvshmemx_vendor_get_version_info(major, minor, patch);
  return ok();
}

PURLIN_NVSHMEM_API int purlin_nvshmem_init_status(int* status) {
  if (!status) return fail(PURLIN_NVSHMEM_ERR_ARGUMENT, "init_status: null output");
  *status = nvshmemx_init_status();
  return ok();
}

PURLIN_NVSHMEM_API int purlin_nvshmem_device_count(int* count) {
  if (!count) return fail(PURLIN_NVSHMEM_ERR_ARGUMENT, "device_count: null output");
  *count = 0;
  cudaError_t err = cudaGetDeviceCount(count);
  if (err != cudaSuccess) return cuda_fail("cudaGetDeviceCount", err);
  return ok();
}

PURLIN_NVSHMEM_API int purlin_nvshmem_mem_info(int device, size_t* free_bytes, size_t* total_bytes) {
  if (!free_bytes || !total_bytes) return fail(PURLIN_NVSHMEM_ERR_ARGUMENT, "mem_info: null output");
  DeviceScope scope;
  if (int rc = scope.enter(device)) return rc;
  cudaError_t err = cudaMemGetInfo(free_bytes, total_bytes);
  if (err != cudaSuccess) return cuda_fail("cudaMemGetInfo", err);
  return ok();
}

PURLIN_NVSHMEM_API int purlin_nvshmem_get_uniqueid(void* out, int nbytes) {
  if (!out || nbytes != (int)sizeof(nvshmemx_uniqueid_t)) {
    return fail(PURLIN_NVSHMEM_ERR_ARGUMENT, "get_uniqueid: needs a %d-byte buffer, got %d",
                (int)sizeof(nvshmemx_uniqueid_t), nbytes);
  }
  nvshmemx_uniqueid_t uid = NVSHMEMX_UNIQUEID_INITIALIZER;
  int status = nvshmemx_get_uniqueid(&uid);
  if (status != 0) return fail(PURLIN_NVSHMEM_ERR_NVSHMEM, "nvshmemx_get_uniqueid returned %d", status);
  memcpy(out, &uid, sizeof(uid));
  return ok();
}

PURLIN_NVSHMEM_API int purlin_nvshmem_init(const void* uid_bytes, int nbytes, int pe, int npes, int device) {
  if (!uid_bytes || nbytes != (int)sizeof(nvshmemx_uniqueid_t)) {
    return fail(PURLIN_NVSHMEM_ERR_ARGUMENT, "init: needs a %d-byte unique id, got %d",
                (int)sizeof(nvshmemx_uniqueid_t), nbytes);
  }
  if (npes < 1 || pe < 0 || pe >= npes) {
    return fail(PURLIN_NVSHMEM_ERR_ARGUMENT, "init: PE %d of %d is out of range", pe, npes);
  }
  int state = nvshmemx_init_status();
  if (state != NVSHMEM_STATUS_NOT_INITIALIZED) {
    return fail(PURLIN_NVSHMEM_ERR_STATE,
                "init: NVSHMEM is already initialised in this process (nvshmemx_init_status() = %d), by "
                "another user of the same libnvshmem_host.so.3 (e.g. torch's NVSHMEM symmetric memory)", state);
  }
  DeviceScope scope;  // NVSHMEM binds to the device current during init
  if (int rc = scope.enter(device)) return rc;
  cudaError_t err = cudaFree(nullptr);  // create the primary context now, so NVSHMEM finds it current
  if (err != cudaSuccess) return cuda_fail("cudaFree(0) (context creation)", err);

  nvshmemx_uniqueid_t uid;
  memcpy(&uid, uid_bytes, sizeof(uid));
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  int status = nvshmemx_set_attr_uniqueid_args(pe, npes, &uid, &attr);
  if (status != 0) return fail(PURLIN_NVSHMEM_ERR_NVSHMEM, "nvshmemx_set_attr_uniqueid_args returned %d", status);
  // The body of the header's inline nvshmemx_init_attr, without its exit(-1) on failure.
  nvshmemx_init_init_attr_ver_only(attr);
  int provided = 0;
  nvshmemi_version_t version = {NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION,
                                NVSHMEM_VENDOR_PATCH_VERSION};
  status = nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided, NVSHMEMX_INIT_WITH_UNIQUEID, &attr, version);
  if (status != 0) {
    return fail(PURLIN_NVSHMEM_ERR_NVSHMEM,
                "nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID) as PE %d of %d returned %d (set NVSHMEM_DEBUG=WARN "
                "for NVSHMEM's own reason)", pe, npes, status);
  }
  if (nvshmem_my_pe() != pe || nvshmem_n_pes() != npes) {
    return fail(PURLIN_NVSHMEM_ERR_NVSHMEM, "init: NVSHMEM says PE %d of %d, asked for PE %d of %d", nvshmem_my_pe(),
                nvshmem_n_pes(), pe, npes);
  }
  return ok();
}

PURLIN_NVSHMEM_API int purlin_nvshmem_pe(int* my_pe, int* n_pes) {
  if (!my_pe || !n_pes) return fail(PURLIN_NVSHMEM_ERR_ARGUMENT, "pe: null output");
  if (int rc = require_initialised("pe")) return rc;
  *my_pe = nvshmem_my_pe();
  *n_pes = nvshmem_n_pes();
  return ok();
}

PURLIN_NVSHMEM_API int purlin_nvshmem_malloc(int device, size_t nbytes, void** out) {
  if (!out || nbytes == 0) return fail(PURLIN_NVSHMEM_ERR_ARGUMENT, "malloc: needs nbytes > 0 and an output");
  *out = nullptr;
  if (int rc = require_initialised("malloc")) return rc;
  DeviceScope scope;
  if (int rc = scope.enter(device)) return rc;
  void* ptr = nvshmem_malloc(nbytes);
  if (!ptr) {
    return fail(PURLIN_NVSHMEM_ERR_NVSHMEM, "nvshmem_malloc(%zu) returned NULL (the symmetric heap is full: "
                "NVSHMEM_SYMMETRIC_SIZE / NVSHMEM_MAX_MEMORY_PER_GPU)", nbytes);
  }
  *out = ptr;  // the caller frees it (collectively) even if zeroing fails below
  cudaError_t err = cudaMemset(ptr, 0, nbytes);
  if (err != cudaSuccess) return cuda_fail("cudaMemset", err);
  err = cudaDeviceSynchronize();
  if (err != cudaSuccess) return cuda_fail("cudaDeviceSynchronize", err);
  return ok();
}

PURLIN_NVSHMEM_API int purlin_nvshmem_ptr(void* ptr, int pe, void** out) {
  if (!out || !ptr) return fail(PURLIN_NVSHMEM_ERR_ARGUMENT, "ptr: null pointer");
  *out = nullptr;
  if (int rc = require_initialised("ptr")) return rc;
  if (pe < 0 || pe >= nvshmem_n_pes()) return fail(PURLIN_NVSHMEM_ERR_ARGUMENT, "ptr: PE %d is out of range", pe);
  void* peer = nvshmem_ptr(ptr, pe);
  if (!peer) {
    return fail(PURLIN_NVSHMEM_ERR_NVSHMEM, "nvshmem_ptr(PE %d) returned NULL: PE %d's memory is not reachable by "
                "loads and stores from here (no NVLink or PCIe P2P path)", pe, pe);
  }
  *out = peer;
  return ok();
}

PURLIN_NVSHMEM_API int purlin_nvshmem_free(int device, void* ptr) {
  if (!ptr) return fail(PURLIN_NVSHMEM_ERR_ARGUMENT, "free: null pointer");
  if (int rc = require_initialised("free")) return rc;
  DeviceScope scope;
  if (int rc = scope.enter(device)) return rc;
  nvshmem_free(ptr);
  return ok();
}

PURLIN_NVSHMEM_API int purlin_nvshmem_finalize(int device) {
  if (int rc = require_initialised("finalize")) return rc;
  DeviceScope scope;
  if (int rc = scope.enter(device)) return rc;
  nvshmem_finalize();
  return ok();
}
