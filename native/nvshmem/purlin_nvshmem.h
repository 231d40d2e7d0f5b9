// The C ABI of libpurlin_nvshmem.so, the nvshmem provider's shim over NVSHMEM's host API.
// Bound from Python by purlin_sglang/memory/nvshmem.py (ctypes); built only where CUDA is on and
// the nvidia-nvshmem-cu13 / -cu12 wheel was importable at build time (native/nvshmem/CMakeLists.txt).
//
// Every entry point returns a purlin_nvshmem_status code (0 = success) and never exits or aborts
// the process on an error it can see; purlin_nvshmem_last_error() then says what failed (the
// NVSHMEM or CUDA call and its code), per thread. Calls that NVSHMEM makes collective (init,
// malloc, free, finalize) are collective here too: every PE calls them, in the same order.
// Bump PURLIN_NVSHMEM_ABI_VERSION (purlin_nvshmem.cu and nvshmem.py) whenever a signature changes.
#pragma once
#include <stddef.h>

#define PURLIN_NVSHMEM_API extern "C" __attribute__((visibility("default")))

enum purlin_nvshmem_status {
  PURLIN_NVSHMEM_OK = 0,
  PURLIN_NVSHMEM_ERR_ARGUMENT = 1,  // a bad argument: nothing was called
  PURLIN_NVSHMEM_ERR_CUDA = 2,      // a CUDA runtime call failed
  PURLIN_NVSHMEM_ERR_NVSHMEM = 3,   // an NVSHMEM call failed (returned non-zero or NULL)
  PURLIN_NVSHMEM_ERR_STATE = 4,     // not initialised, or initialised by someone else
};

PURLIN_NVSHMEM_API int purlin_nvshmem_abi_version(void);
// JSON: {"abi": 1, "nvshmem": "3.4.5" (the headers it was compiled against)}
PURLIN_NVSHMEM_API const char* purlin_nvshmem_build_info(void);
// The message of this thread's last failed call ("" if none).
PURLIN_NVSHMEM_API const char* purlin_nvshmem_last_error(void);
// sizeof(nvshmemx_uniqueid_t): the bytes a unique id travels as (128 in NVSHMEM 3.x).
PURLIN_NVSHMEM_API int purlin_nvshmem_uniqueid_bytes(void);
// The NVSHMEM host library's own version (loaded at run time; may differ from the headers').
PURLIN_NVSHMEM_API int purlin_nvshmem_runtime_version(int* major, int* minor, int* patch);
// nvshmemx_init_status(): 0 not initialised, 1 bootstrapped, 2 initialised, 3/4 multi-process-per-GPU.
PURLIN_NVSHMEM_API int purlin_nvshmem_init_status(int* status);
// cudaGetDeviceCount, and cudaMemGetInfo on `device` (makes it current).
PURLIN_NVSHMEM_API int purlin_nvshmem_device_count(int* count);
PURLIN_NVSHMEM_API int purlin_nvshmem_mem_info(int device, size_t* free_bytes, size_t* total_bytes);

// On the root PE only: a fresh unique id into out[0:nbytes] (nbytes must be uniqueid_bytes()).
PURLIN_NVSHMEM_API int purlin_nvshmem_get_uniqueid(void* out, int nbytes);
// Collective over the `npes` processes: make `device` current and initialise NVSHMEM with the
// unique-id bootstrap (nvshmemx_set_attr_uniqueid_args + init with NVSHMEMX_INIT_WITH_UNIQUEID)
// as PE `pe`. Refused (ERR_STATE) where NVSHMEM is already initialised in this process.
PURLIN_NVSHMEM_API int purlin_nvshmem_init(const void* uid, int nbytes, int pe, int npes, int device);
// nvshmem_my_pe() / nvshmem_n_pes() of the initialised library.
PURLIN_NVSHMEM_API int purlin_nvshmem_pe(int* my_pe, int* n_pes);
// Collective: nvshmem_malloc(nbytes) on `device`, zeroed (cudaMemset, then cudaDeviceSynchronize).
PURLIN_NVSHMEM_API int purlin_nvshmem_malloc(int device, size_t nbytes, void** out);
// nvshmem_ptr(ptr, pe): the address of PE `pe`'s copy of the symmetric object `ptr`, as mapped in
// this process (NULL, and ERR_NVSHMEM, where PE `pe` is not reachable by loads and stores).
PURLIN_NVSHMEM_API int purlin_nvshmem_ptr(void* ptr, int pe, void** out);
// Collective: nvshmem_free(ptr) (a barrier on entry in NVSHMEM).
PURLIN_NVSHMEM_API int purlin_nvshmem_free(int device, void* ptr);
// Collective: nvshmem_finalize().
PURLIN_NVSHMEM_API int purlin_nvshmem_finalize(int device);
