# Third-party libraries, all from Debian packages (see .ci/run for the apt line).
#
# The GPU machine lacks most of them (no apt there). tools/gpu_deps.sh copies headers and
# libraries from this machine's packages into the ignored folder .gpu_deps/ (include/, lib/),
# which the `run` tool carries over; every library below falls back to it when the system has no
# package. M3_KERNELS_ONLY builds need only tl-expected, nlohmann-json and gtest.
find_package(Threads REQUIRED)
set(M3_GPU_DEPS ${PROJECT_SOURCE_DIR}/.gpu_deps)

# Header-only library `target` from .gpu_deps/include when its package is absent.
function(m3_header_fallback target header)
  if(NOT TARGET ${target})
    string(MAKE_C_IDENTIFIER "M3_INC_${header}" var)
    find_path(${var} ${header} HINTS ${M3_GPU_DEPS}/include)
    if(NOT ${var})
      message(FATAL_ERROR "${target} not found: install its Debian package (tools/setup.sh) or "
                          "fill .gpu_deps/ with tools/gpu_deps.sh")
    endif()
    add_library(${target} INTERFACE IMPORTED GLOBAL)
    target_include_directories(${target} INTERFACE ${${var}})
  endif()
endfunction()

# A static (or shared) library `target` from .gpu_deps/lib/`file` when its package is absent.
function(m3_lib_fallback target kind file)
  if(NOT TARGET ${target})
    set(path ${M3_GPU_DEPS}/lib/${file})
    if(NOT EXISTS ${path})
      message(FATAL_ERROR "${target} not found: install its Debian package (tools/setup.sh) or "
                          "fill .gpu_deps/ with tools/gpu_deps.sh (no ${path})")
    endif()
    add_library(${target} ${kind} IMPORTED GLOBAL)
    set_target_properties(${target} PROPERTIES IMPORTED_LOCATION ${path}
      INTERFACE_INCLUDE_DIRECTORIES ${M3_GPU_DEPS}/include)
  endif()
endfunction()

find_package(tl-expected QUIET)
m3_header_fallback(tl::expected tl/expected.hpp)
find_package(nlohmann_json 3.10 QUIET)
m3_header_fallback(nlohmann_json::nlohmann_json nlohmann/json.hpp)
find_package(GTest QUIET)
if(NOT TARGET GTest::gtest)
  m3_lib_fallback(GTest::gtest STATIC libgtest.a)
  set_target_properties(GTest::gtest PROPERTIES INTERFACE_LINK_LIBRARIES Threads::Threads)
  m3_lib_fallback(GTest::gtest_main STATIC libgtest_main.a)
  set_target_properties(GTest::gtest_main PROPERTIES INTERFACE_LINK_LIBRARIES GTest::gtest)
endif()
if(M3_KERNELS_ONLY)
  return()
endif()

find_package(CLI11 QUIET)
m3_header_fallback(CLI11::CLI11 CLI/CLI.hpp)
find_package(PkgConfig QUIET)
if(PKG_CONFIG_FOUND)
  pkg_check_modules(PCRE2 QUIET IMPORTED_TARGET libpcre2-8)
  pkg_check_modules(UTF8PROC QUIET IMPORTED_TARGET libutf8proc)
  pkg_check_modules(XXHASH QUIET IMPORTED_TARGET libxxhash)
endif()
m3_lib_fallback(PkgConfig::PCRE2 STATIC libpcre2-8.a)
m3_lib_fallback(PkgConfig::UTF8PROC STATIC libutf8proc.a)
m3_lib_fallback(PkgConfig::XXHASH STATIC libxxhash.a)
# KV events (engine/kv_event_publisher.cpp): ZeroMQ (libzmq3-dev) with its C++ header cppzmq
# (cppzmq-dev), and msgpack-cxx's header-only packer (libmsgpack-cxx-dev) with its Boost
# adaptors off. On the GPU machine libzmq comes as the shared library and the .so files it
# needs that Ubuntu lacks, from .gpu_deps/lib (tools/gpu_deps.sh).
if(PKG_CONFIG_FOUND)
  pkg_check_modules(ZMQ QUIET IMPORTED_TARGET libzmq)
endif()
if(NOT TARGET PkgConfig::ZMQ)
  m3_lib_fallback(PkgConfig::ZMQ SHARED libzmq.so.5)
  # libzmq's own dependencies (libsodium, libpgm, libnorm) sit next to it: an RPATH (not a
  # RUNPATH) is inherited by them, so the loader finds them there too.
  set_target_properties(PkgConfig::ZMQ PROPERTIES INTERFACE_LINK_OPTIONS "-Wl,--disable-new-dtags")
endif()
m3_header_fallback(m3::cppzmq zmq.hpp)
m3_header_fallback(m3::msgpack msgpack.hpp)
set_target_properties(m3::msgpack PROPERTIES INTERFACE_COMPILE_DEFINITIONS MSGPACK_NO_BOOST)
# Image decoders of the vision input (src/vision): Debian's libjpeg-turbo, libpng, libwebp.
# Decoded pixels must be byte-identical to the tested build (tests/unit/vision), so when
# .gpu_deps/ holds the development machine's static archives (the GPU machine) those are used
# even if the system has other versions (libpng there links the copied zlib).
if(PKG_CONFIG_FOUND AND NOT EXISTS ${M3_GPU_DEPS}/lib/libjpeg.a)
  pkg_check_modules(LIBJPEG QUIET IMPORTED_TARGET libjpeg)
  pkg_check_modules(LIBPNG QUIET IMPORTED_TARGET libpng16)
  pkg_check_modules(LIBWEBP QUIET IMPORTED_TARGET libwebp)
endif()
foreach(img jpeg png webp)
  string(TOUPPER ${img} IMG)
  if(TARGET PkgConfig::LIB${IMG})
    add_library(M3::${img} INTERFACE IMPORTED)
    set_target_properties(M3::${img} PROPERTIES INTERFACE_LINK_LIBRARIES PkgConfig::LIB${IMG})
  endif()
endforeach()
m3_lib_fallback(M3::jpeg STATIC libjpeg.a)
m3_lib_fallback(M3::webp STATIC libwebp.a)
if(NOT TARGET M3::png)
  m3_lib_fallback(M3::zlib STATIC libz.a)
  m3_lib_fallback(M3::png STATIC libpng16.a)
  set_target_properties(M3::png PROPERTIES INTERFACE_LINK_LIBRARIES "M3::zlib;m")
endif()
if(TARGET PkgConfig::LIBJPEG)
  message(STATUS "image decoders: system libjpeg ${LIBJPEG_VERSION}, libpng ${LIBPNG_VERSION}, "
                 "libwebp ${LIBWEBP_VERSION}")
else()
  message(STATUS "image decoders: static libjpeg, libpng, libwebp from ${M3_GPU_DEPS}")
endif()
# GIF images (the first frame, as PIL loads it): Debian's giflib. Optional: without it (the GPU
# machine's .gpu_deps/ does not carry it) GIF parts get a 400 that says so (M3_HAVE_GIF=0).
find_package(GIF QUIET)
if(TARGET GIF::GIF)
  message(STATUS "GIF images: giflib ${GIF_VERSION}")
else()
  message(STATUS "GIF images: off (no giflib)")
endif()
# Video decoding of the vision input (src/vision/video_decode.cpp): Debian's libavformat,
# libavcodec, libswscale, libavutil. Optional: a build without them (the GPU machine, whose
# .gpu_deps/ does not carry them: they are large and pull in every codec library) refuses video
# parts with a 400 that says so (M3_HAVE_LIBAV=0).
option(M3_VIDEO "Video input (needs libavformat, libavcodec, libswscale, libavutil)" ON)
if(M3_VIDEO AND PKG_CONFIG_FOUND)
  pkg_check_modules(LIBAV QUIET IMPORTED_TARGET libavformat libavcodec libswscale libavutil)
endif()
if(TARGET PkgConfig::LIBAV)
  message(STATUS "video decoding: libavformat ${LIBAV_libavformat_VERSION}, libavcodec "
                 "${LIBAV_libavcodec_VERSION}")
else()
  message(STATUS "video decoding: off (no libavformat/libavcodec/libswscale/libavutil)")
endif()
# xgrammar (structured outputs) from its PyPI sdist: tools/setup.sh unpacks it into .deps/, and
# tools/gpu_deps.sh copies the parts the build needs into .gpu_deps/ for the GPU machine. Built
# as a static library with its own flags, its Python bindings off. Without it, m3serve builds
# and refuses structured outputs by name (M3_HAS_XGRAMMAR unset).
set(M3_XGRAMMAR_VERSION 0.2.8)
find_path(M3_XGRAMMAR_DIR CMakeLists.txt NO_DEFAULT_PATH
  PATHS ${PROJECT_SOURCE_DIR}/.deps/xgrammar-${M3_XGRAMMAR_VERSION}
        ${M3_GPU_DEPS}/xgrammar-${M3_XGRAMMAR_VERSION})
if(M3_XGRAMMAR_DIR AND NOT TARGET xgrammar)
  # Its CMakeLists includes ${CMAKE_BINARY_DIR}/config.cmake before its own cmake/config.cmake
  # (which turns the Python bindings on): this one turns them, tests and cpptrace off.
  file(WRITE ${CMAKE_BINARY_DIR}/config.cmake
    "# Written by m3serve's cmake/deps.cmake for xgrammar's CMakeLists.\n"
    "set(XGRAMMAR_BUILD_PYTHON_BINDINGS OFF)\nset(XGRAMMAR_BUILD_CXX_TESTS OFF)\n"
    "set(XGRAMMAR_ENABLE_CPPTRACE OFF)\nset(XGRAMMAR_ENABLE_COVERAGE OFF)\n"
    "set(XGRAMMAR_ENABLE_INTERNAL_CHECK OFF)\n")
  # It prepends -Werror and -flto=auto to CMAKE_CXX_FLAGS: our flags come after and win (an LTO
  # archive would need gcc-ar, and its warnings under newer compilers are not ours to fix).
  set(m3_saved_cxx_flags "${CMAKE_CXX_FLAGS}")
  set(CMAKE_CXX_FLAGS "${CMAKE_CXX_FLAGS} -fno-lto -Wno-error")
  add_subdirectory(${M3_XGRAMMAR_DIR} ${CMAKE_BINARY_DIR}/_deps/xgrammar EXCLUDE_FROM_ALL)
  set(CMAKE_CXX_FLAGS "${m3_saved_cxx_flags}")
  message(STATUS "xgrammar ${M3_XGRAMMAR_VERSION}: ${M3_XGRAMMAR_DIR} (structured outputs on)")
elseif(NOT M3_XGRAMMAR_DIR)
  message(STATUS "xgrammar not found (run tools/setup.sh, or tools/gpu_deps.sh for the GPU "
                 "machine): structured outputs will be refused")
endif()
