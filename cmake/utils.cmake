# Small helpers for CMakeLists.txt.

# run_python(OUT EXPR ERROR): sets OUT to what `print(EXPR)` prints in the build's Python.
function(run_python OUT EXPR ERROR)
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c "import sys; print(${EXPR}, end='')"
    OUTPUT_VARIABLE value
    ERROR_VARIABLE stderr
    RESULT_VARIABLE status)
  if(NOT status EQUAL 0)
    message(FATAL_ERROR "${ERROR}: ${stderr}")
  endif()
  set(${OUT} "${value}" PARENT_SCOPE)
endfunction()

# append_cmake_prefix_path(PKG EXPR): adds the CMake prefix path that a Python package reports.
macro(append_cmake_prefix_path PKG EXPR)
  run_python(_prefix "__import__('importlib').import_module('${PKG}').${EXPR}" "Failed to locate ${PKG}'s CMake files")
  list(APPEND CMAKE_PREFIX_PATH "${_prefix}")
endmacro()

# find_cudnn(): sets CUDNN_INCLUDE_DIR and CUDNN_LIBRARY (-NOTFOUND when absent). Looks where
# pip installs cuDNN for torch (the nvidia-cudnn-cu* package), then CUDNN_ROOT, then the toolkit.
function(find_cudnn)
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c "import nvidia.cudnn as m; print(list(m.__path__)[0], end='')"
    OUTPUT_VARIABLE pip_cudnn
    ERROR_QUIET)
  find_path(CUDNN_INCLUDE_DIR cudnn.h
    HINTS "${pip_cudnn}/include" "$ENV{CUDNN_ROOT}/include" ${CUDAToolkit_INCLUDE_DIRS})
  find_library(CUDNN_LIBRARY NAMES cudnn libcudnn.so.9
    HINTS "${pip_cudnn}/lib" "$ENV{CUDNN_ROOT}/lib" "$ENV{CUDNN_ROOT}/lib64" ${CUDAToolkit_LIBRARY_DIR})
endfunction()
