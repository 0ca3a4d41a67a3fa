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

# find_cuda_paths(CUDA_VERSION): sets CUDA_PATHS_<KEY> for each KEY that cmake/cuda_paths.py
# prints (INCLUDE_DIRS, CUDART, CUDNN_INCLUDE_DIR, CUDNN_LIBRARY, MISSING, SEARCHED).
function(find_cuda_paths CUDA_VERSION)
  execute_process(
    COMMAND "${Python_EXECUTABLE}" "${PROJECT_SOURCE_DIR}/cmake/cuda_paths.py" --cuda-version "${CUDA_VERSION}"
    OUTPUT_VARIABLE lines
    ERROR_VARIABLE stderr
    RESULT_VARIABLE status)
  if(NOT status EQUAL 0)
    message(FATAL_ERROR "cmake/cuda_paths.py failed: ${stderr}")
  endif()
  string(REPLACE "\n" ";" lines "${lines}")
  foreach(line IN LISTS lines)
    if(line MATCHES "^([A-Z_]+)=(.*)$")
      string(REPLACE "|" ";" value "${CMAKE_MATCH_2}")
      set(CUDA_PATHS_${CMAKE_MATCH_1} "${value}" PARENT_SCOPE)
    endif()
  endforeach()
endfunction()

# torch_from_python(WITH_CUDA): sets TORCH_LIBRARIES and TORCH_PYTHON_LIBRARY, and adds torch's
# include folders and ABI flag, from what the installed torch reports (torch.utils.cpp_extension);
# with WITH_CUDA, torch's CUDA libraries too.
macro(torch_from_python WITH_CUDA)
  run_python(_torch_includes "';'.join(__import__('torch.utils.cpp_extension').utils.cpp_extension.include_paths())"
             "Failed to query torch's include folders")
  run_python(_torch_lib "__import__('os').path.join(__import__('torch').__path__[0], 'lib')" "Failed to locate torch")
  run_python(_torch_abi "int(__import__('torch').compiled_with_cxx11_abi())" "Failed to query torch's ABI")
  include_directories(SYSTEM ${_torch_includes})
  add_compile_definitions(_GLIBCXX_USE_CXX11_ABI=${_torch_abi})
  set(_torch_names c10 torch torch_cpu)
  if(${WITH_CUDA})
    list(APPEND _torch_names c10_cuda torch_cuda)
  endif()
  set(TORCH_LIBRARIES "")
  foreach(_name IN LISTS _torch_names)
    find_library(_torch_library_${_name} ${_name} PATHS "${_torch_lib}" REQUIRED NO_DEFAULT_PATH)
    list(APPEND TORCH_LIBRARIES "${_torch_library_${_name}}")
  endforeach()
  find_library(TORCH_PYTHON_LIBRARY torch_python PATHS "${_torch_lib}" REQUIRED NO_DEFAULT_PATH)
endmacro()

# link_shared_libstdcxx(TARGET): links TARGET to the shared C++ runtime torch runs with, never
# to a copy of it. `-lstdc++` takes the first directory of the search path holding either
# libstdc++.so or libstdc++.a, and a toolchain whose own prefix (`g++ -B<dir>`, as a GPU image's
# /opt/gcc/bin/g++ wrapper does) holds only the archive gets it linked statically; so does
# `-static-libstdc++`. The module then carries a second libstdc++ whose locale torch's never
# initialised: a number written to a std::ostringstream comes out empty or crashes the process.
# `-l:libstdc++.so.6` names the shared object itself (the runtime's soname, in the system's
# library directory), after the objects and before the driver's own runtime libraries, so it
# resolves every symbol and an archive named later adds nothing; inside --push-state,-Bdynamic
# so that a -Bstatic in effect from the flags before it does not refuse the shared object.
function(link_shared_libstdcxx TARGET)
  if(NOT (CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND CMAKE_SYSTEM_NAME STREQUAL "Linux"))
    return()
  endif()
  include(CheckLinkerFlag)
  set(dynamic "LINKER:--push-state,-Bdynamic,-l:libstdc++.so.6,--pop-state")
  check_linker_flag(CXX "${dynamic}" SHAPECACHE_LINKER_TAKES_LIBSTDCXX_SO_DYNAMIC)
  check_linker_flag(CXX "-l:libstdc++.so.6" SHAPECACHE_LINKER_FINDS_LIBSTDCXX_SO)
  if(SHAPECACHE_LINKER_TAKES_LIBSTDCXX_SO_DYNAMIC)
    target_link_libraries(${TARGET} PRIVATE "-Wl,--push-state,-Bdynamic,-l:libstdc++.so.6,--pop-state")
  elseif(SHAPECACHE_LINKER_FINDS_LIBSTDCXX_SO)
    target_link_libraries(${TARGET} PRIVATE "-l:libstdc++.so.6")
  else()
    message(WARNING "the linker finds no libstdc++.so.6: the module may carry a static copy of libstdc++, whose "
                    "numbers in messages come out empty or crash (docs/gpu.md)")
  endif()
endfunction()
