# Third-party libraries, all from Debian packages (see .ci/run for the apt line).
find_package(Threads REQUIRED)
if(M3_KERNELS_ONLY)
  # Kernels-only build (GPU machine): core needs tl::expected and the tests need gtest. Take the
  # installed packages when present, else headers/static libraries carried in .gpu_deps/
  # (include/tl/expected.hpp, include/nlohmann/, include/gtest/, lib/libgtest.a,
  # lib/libgtest_main.a).
  set(M3_GPU_DEPS ${PROJECT_SOURCE_DIR}/.gpu_deps)
  find_package(tl-expected QUIET)
  if(NOT TARGET tl::expected)
    find_path(M3_TL_EXPECTED_INCLUDE tl/expected.hpp HINTS ${M3_GPU_DEPS}/include REQUIRED)
    add_library(tl::expected INTERFACE IMPORTED)
    target_include_directories(tl::expected INTERFACE ${M3_TL_EXPECTED_INCLUDE})
  endif()
  # m3_model reads config.json and safetensors headers with nlohmann-json (header-only).
  find_package(nlohmann_json 3.10 QUIET)
  if(NOT TARGET nlohmann_json::nlohmann_json)
    find_path(M3_NLOHMANN_INCLUDE nlohmann/json.hpp HINTS ${M3_GPU_DEPS}/include REQUIRED)
    add_library(nlohmann_json::nlohmann_json INTERFACE IMPORTED)
    target_include_directories(nlohmann_json::nlohmann_json INTERFACE ${M3_NLOHMANN_INCLUDE})
  endif()
  find_package(GTest QUIET)
  if(NOT TARGET GTest::gtest)
    find_path(M3_GTEST_INCLUDE gtest/gtest.h HINTS ${M3_GPU_DEPS}/include REQUIRED)
    find_library(M3_GTEST_LIB gtest HINTS ${M3_GPU_DEPS}/lib REQUIRED)
    find_library(M3_GTEST_MAIN_LIB gtest_main HINTS ${M3_GPU_DEPS}/lib REQUIRED)
    add_library(GTest::gtest STATIC IMPORTED)
    set_target_properties(GTest::gtest PROPERTIES IMPORTED_LOCATION ${M3_GTEST_LIB}
      INTERFACE_INCLUDE_DIRECTORIES ${M3_GTEST_INCLUDE} INTERFACE_LINK_LIBRARIES Threads::Threads)
    add_library(GTest::gtest_main STATIC IMPORTED)
    set_target_properties(GTest::gtest_main PROPERTIES IMPORTED_LOCATION ${M3_GTEST_MAIN_LIB}
      INTERFACE_LINK_LIBRARIES GTest::gtest)
  endif()
  return()
endif()
find_package(PkgConfig REQUIRED)
find_package(nlohmann_json 3.10 REQUIRED)
find_package(tl-expected REQUIRED)
find_package(CLI11 REQUIRED)
find_package(GTest REQUIRED)
pkg_check_modules(PCRE2 REQUIRED IMPORTED_TARGET libpcre2-8)
pkg_check_modules(UTF8PROC REQUIRED IMPORTED_TARGET libutf8proc)
pkg_check_modules(HTTPLIB REQUIRED IMPORTED_TARGET cpp-httplib)
pkg_check_modules(XXHASH REQUIRED IMPORTED_TARGET libxxhash)
