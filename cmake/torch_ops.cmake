# The C++ PyTorch ops library, flashhopper_torch (src/torch/ops.cpp), when a usable torch is found.
# Only torch's stable-ABI headers are used, with TORCH_TARGET_VERSION 2.9: the binary then calls
# nothing a PyTorch from 2.9 on lacks. It links torch's libraries by their unversioned names, which
# the importing process has already loaded.
# The Python: FLASHHOPPER_PYTHON, else the one a pip build runs (scikit-build-core passes it), else
# python3 on the path.
set(FLASHHOPPER_PYTHON "$ENV{FLASHHOPPER_PYTHON}" CACHE STRING "Python whose torch the C++ ops build against")
if(NOT FLASHHOPPER_PYTHON AND Python_EXECUTABLE)
  set(FLASHHOPPER_PYTHON "${Python_EXECUTABLE}")
elseif(NOT FLASHHOPPER_PYTHON AND Python3_EXECUTABLE)
  set(FLASHHOPPER_PYTHON "${Python3_EXECUTABLE}")
elseif(NOT FLASHHOPPER_PYTHON)
  find_program(_fh_python NAMES python3 python)
  set(FLASHHOPPER_PYTHON "${_fh_python}")
endif()
set(_torch_found FALSE)
if(FLASHHOPPER_PYTHON)
  execute_process(
    COMMAND "${FLASHHOPPER_PYTHON}" -c
      "import os, torch; v = tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); \
print(os.path.dirname(torch.__file__) + ';' + ('ok' if v >= (2, 9) else 'old') + ';' + torch.__version__)"
    OUTPUT_VARIABLE _torch_query OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _torch_rc ERROR_QUIET)
  if(_torch_rc EQUAL 0)
    list(GET _torch_query 0 _torch_dir)
    list(GET _torch_query 1 _torch_new_enough)
    list(GET _torch_query 2 _torch_version)
    find_library(_torch_cpu torch_cpu PATHS "${_torch_dir}/lib" NO_DEFAULT_PATH)
    find_library(_torch_cuda torch_cuda PATHS "${_torch_dir}/lib" NO_DEFAULT_PATH)
    if(_torch_new_enough STREQUAL "ok" AND _torch_cpu AND _torch_cuda
       AND EXISTS "${_torch_dir}/include/torch/csrc/stable/library.h")
      set(_torch_found TRUE)
    endif()
  endif()
endif()

if(_torch_found)
  message(STATUS "C++ PyTorch ops: against torch ${_torch_version} (${_torch_dir}), for PyTorch >= 2.9")
  add_library(flashhopper_torch SHARED src/torch/ops.cpp)
  target_include_directories(flashhopper_torch SYSTEM PRIVATE "${_torch_dir}/include")
  target_compile_definitions(flashhopper_torch PRIVATE USE_CUDA TORCH_TARGET_VERSION=0x0209000000000000)
  target_link_libraries(flashhopper_torch PRIVATE flashhopper "${_torch_cpu}" "${_torch_cuda}")
  # next to libflashhopper.so, where it is found and finds it
  set_target_properties(flashhopper_torch PROPERTIES LIBRARY_OUTPUT_DIRECTORY "${CMAKE_BINARY_DIR}"
                        BUILD_RPATH "\$ORIGIN" INSTALL_RPATH "\$ORIGIN" SKIP_BUILD_RPATH OFF)
elseif(FLASHHOPPER_TORCH_OPS STREQUAL "ON")
  message(FATAL_ERROR "FLASHHOPPER_TORCH_OPS=ON: FLASHHOPPER_PYTHON='${FLASHHOPPER_PYTHON}' does not import a "
                      "CUDA build of torch >= 2.9 (found: '${_torch_query}')")
else()
  message(STATUS "C++ PyTorch ops: not built (no CUDA build of torch >= 2.9 in '${FLASHHOPPER_PYTHON}'); "
                 "the Python package uses its own implementation of the ops")
endif()
