# CUDA is switched on only when nvcc is found (and M3_CUDA is not OFF). The CUDA code lives in
# src/gpu (RAII, error checks) and src/kernels/cuda (ops); everything else builds without it.
set(M3_CUDA AUTO CACHE STRING "Build the CUDA backend: AUTO (when nvcc is found), ON, OFF")
set(M3_HAS_CUDA OFF)
if(NOT M3_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 90a)
    endif()
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    set(M3_HAS_CUDA ON)
    # CMake 3.25 does not know nvcc's C++20 flag, yet CUDA targets inherit CXX_STANDARD 20 and
    # fail to generate ("requires the language dialect CUDA20"): tell it the flag. Newer CMake
    # (4.x on the GPU machine) knows it already. The flag is passed by hand as well (same
    # value twice is accepted silently by nvcc).
    if(NOT CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
      set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
      set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
    endif()
    set(M3_CUDA_FLAGS -std=c++20 --expt-relaxed-constexpr)
  elseif(M3_CUDA STREQUAL "ON")
    message(FATAL_ERROR "M3_CUDA=ON but no CUDA compiler was found; install the CUDA toolkit or use -DM3_CUDA=OFF")
  endif()
endif()
message(STATUS "m3serve CUDA backend: ${M3_HAS_CUDA}")
