# Which kernel instantiations this build compiles: the families of the chosen kernel set in the
# manifest (scripts/kernel_manifest.py, generated into cmake/kernel_manifest.cmake), a file per
# family and feature set holding every mask kind and softcap. FLASHHOPPER_KERNEL_SET (the set's
# index) reaches the dispatch (src/launch/compiled_families.hpp), so a call for a family left out
# is refused by name rather than failing to link.
include(${CMAKE_CURRENT_LIST_DIR}/kernel_manifest.cmake)
list(FIND FLASHHOPPER_KERNEL_SETS "${FLASHHOPPER_KERNELS}" _set_index)
if(_set_index LESS 0)
  message(FATAL_ERROR "FLASHHOPPER_KERNELS must be one of ${FLASHHOPPER_KERNEL_SETS}, not '${FLASHHOPPER_KERNELS}'")
endif()

set(FLASHHOPPER_KERNEL_SOURCES ${PROJECT_SOURCE_DIR}/src/launch/forward_dispatch.cu
    ${PROJECT_SOURCE_DIR}/src/launch/backward_dispatch.cu ${PROJECT_SOURCE_DIR}/src/launch/varlen_plan.cu
    ${PROJECT_SOURCE_DIR}/src/launch/combine_launch.cu ${PROJECT_SOURCE_DIR}/src/launch/kv_append_launch.cu
    ${PROJECT_SOURCE_DIR}/src/launch/packed_decode_launch.cu
    ${PROJECT_SOURCE_DIR}/src/launch/tensor_map_encode.cu)
set(FLASHHOPPER_KERNEL_DEFINES FLASHHOPPER_KERNEL_SET=${_set_index})
foreach(_file IN LISTS FLASHHOPPER_KERNEL_FILES_${FLASHHOPPER_KERNELS})
  list(APPEND FLASHHOPPER_KERNEL_SOURCES ${PROJECT_SOURCE_DIR}/src/hopper/instantiations/${_file}.cu)
endforeach()
list(LENGTH FLASHHOPPER_KERNEL_FAMILIES_${FLASHHOPPER_KERNELS} _count)
list(LENGTH FLASHHOPPER_KERNEL_FILES_${FLASHHOPPER_KERNELS} _files)
message(STATUS "FlashHopper kernels: set ${FLASHHOPPER_KERNELS}, ${_count} families "
               "(${FLASHHOPPER_KERNEL_FAMILIES_${FLASHHOPPER_KERNELS}})")
message(STATUS "FlashHopper kernels: ${FLASHHOPPER_KERNEL_COUNT_${FLASHHOPPER_KERNELS}} instantiations in ${_files} "
               "files, one to two minutes of one core each (README, Build times); the build counts them off as "
               "each finishes")
