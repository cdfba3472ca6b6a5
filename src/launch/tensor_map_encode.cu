// CuTe builds every TMA descriptor through cuTensorMapEncodeTiled. By default CUTLASS looks that
// driver function up (cudaGetDriverEntryPointByVersion, a search by name) on every descriptor,
// four to six a launch. The kernels' build renames the call (CMakeLists.txt: -DcuTensorMapEncodeTiled=
// flashhopper_tensor_map_encode_tiled, with CUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL) to this
// function, which looks it up once per process. Resolved at run time as before, so the library
// still links no libcuda and loads on machines without a driver.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

namespace {

PFN_cuTensorMapEncodeTiled_v12000 driver_encode_tiled() {
  void* function = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &function, 12000, cudaEnableDefault, &found) !=
          cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    cudaGetLastError();  // leaves no sticky error behind for the launch's own check
    return nullptr;
  }
  return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(function);
}

}  // namespace

// cuda.h declares it (renamed) with cuTensorMapEncodeTiled's signature and C linkage.
extern "C" __attribute__((visibility("hidden"))) CUresult flashhopper_tensor_map_encode_tiled(
    CUtensorMap* map, CUtensorMapDataType type, cuuint32_t rank, void* address, const cuuint64_t* dims,
    const cuuint64_t* strides, const cuuint32_t* box, const cuuint32_t* element_strides,
    CUtensorMapInterleave interleave, CUtensorMapSwizzle swizzle, CUtensorMapL2promotion l2_promotion,
    CUtensorMapFloatOOBfill oob_fill) {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = driver_encode_tiled();
  if (encode == nullptr) return CUDA_ERROR_NOT_FOUND;
  return encode(map, type, rank, address, dims, strides, box, element_strides, interleave, swizzle, l2_promotion,
                oob_fill);
}
