# Compiler flags shared by every target. Warnings are errors for our own code.
set(M3_WARNINGS -Wall -Wextra -Werror -Wno-unused-parameter -Wno-sign-compare -Wno-missing-field-initializers
    -Wno-restrict)  # GCC 12 -O3 false positives inside std::string (GCC bug 105329)

option(M3_NATIVE "Tune the CPU kernels for this machine (-march=native)" OFF)
set(M3_CPU_FLAGS "")
if(M3_NATIVE)
  list(APPEND M3_CPU_FLAGS -march=native)
else()
  # x86-64-v3 (AVX2 + FMA) is on every machine we run on; -mno-... keeps it portable when not.
  include(CheckCXXCompilerFlag)
  check_cxx_compiler_flag(-march=x86-64-v3 M3_HAS_V3)
  if(M3_HAS_V3)
    list(APPEND M3_CPU_FLAGS -march=x86-64-v3)
  endif()
endif()

option(M3_ASAN "Build with AddressSanitizer and UBSan" OFF)
if(M3_ASAN)
  add_compile_options(-fsanitize=address,undefined -fno-omit-frame-pointer)
  add_link_options(-fsanitize=address,undefined)
endif()

find_program(CCACHE_PROGRAM ccache)
if(CCACHE_PROGRAM)
  set(CMAKE_CXX_COMPILER_LAUNCHER ${CCACHE_PROGRAM})
  set(CMAKE_CUDA_COMPILER_LAUNCHER ${CCACHE_PROGRAM})
endif()

# m3_library(name SOURCES... DEPS...): a folder's static library with our flags.
function(m3_library name)
  cmake_parse_arguments(A "" "" "SOURCES;DEPS;PRIVATE_DEPS" ${ARGN})
  add_library(${name} STATIC ${A_SOURCES})
  target_include_directories(${name} PUBLIC ${PROJECT_SOURCE_DIR}/src)
  target_compile_options(${name} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${M3_WARNINGS} ${M3_CPU_FLAGS}>)
  target_link_libraries(${name} PUBLIC ${A_DEPS} PRIVATE ${A_PRIVATE_DEPS})
endfunction()
