// ABI version and build info: host-only, present in every build (with or without CUDA).
#include "purlin/native.h"
#include "purlin_build_info.h"

PURLIN_API int purlin_native_abi_version(void) { return PURLIN_NATIVE_ABI_VERSION; }

PURLIN_API const char* purlin_native_build_info(void) { return PURLIN_BUILD_INFO_JSON; }
