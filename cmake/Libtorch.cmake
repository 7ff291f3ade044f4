# Imported targets for libtorch from a PyPI torch wheel, declared by hand instead of
# find_package(Torch): the wheel's TorchConfig runs CUDA detection at configure time, and we want
# to decide CPU-only vs CUDA ourselves (see ../shared/LIBTORCH-NOTES.md).
#
# Input:  FSDP_TORCH_DIR  the wheel's package folder (site-packages/torch).
#         FSDP_TORCH_INCLUDE_MIRROR (optional) where to put the include mirror below; default
#                         <build>/torch_include. The installed package (cmake/Install.cmake)
#                         includes this file too, to declare the same targets for a user's project.
# Output: fsdp::torch     CPU libtorch (libtorch_cpu, libc10) + headers + c10d Gloo defines.
#         fsdp::torch_cuda libtorch_cuda, libc10_cuda, CUDA runtime, NCCL (only if FSDP_CUDA).
#         FSDP_CUDA        ON when the wheel's CUDA major equals the toolkit's (or forced).
#         FSDP_TORCH_VERSION, FSDP_TORCH_CUDA_VERSION, FSDP_TORCH_RPATH (list of lib dirs).

if(NOT FSDP_TORCH_DIR OR NOT EXISTS "${FSDP_TORCH_DIR}/lib/libtorch_cpu.so")
  message(FATAL_ERROR
    "FSDP_TORCH_DIR='${FSDP_TORCH_DIR}' is not a torch wheel folder (no lib/libtorch_cpu.so). "
    "Run `make build` (it runs scripts/bootstrap.sh) or pass -DFSDP_TORCH_DIR=.../site-packages/torch")
endif()

# --- versions from the wheel's version.py ---------------------------------------------------
file(STRINGS "${FSDP_TORCH_DIR}/version.py" _tv REGEX "^__version__ *=")
string(REGEX REPLACE ".*'([^']*)'.*" "\\1" FSDP_TORCH_VERSION "${_tv}")
file(STRINGS "${FSDP_TORCH_DIR}/version.py" _tc REGEX "^cuda *[:=]")
set(FSDP_TORCH_CUDA_VERSION "")
if(_tc MATCHES "'([0-9.]+)'")
  set(FSDP_TORCH_CUDA_VERSION "${CMAKE_MATCH_1}")
endif()
message(STATUS "fsdp.cpp: torch ${FSDP_TORCH_VERSION} at ${FSDP_TORCH_DIR}")
message(STATUS "fsdp.cpp: torch wheel built for CUDA: ${FSDP_TORCH_CUDA_VERSION}")

set(_tlib "${FSDP_TORCH_DIR}/lib")
set(FSDP_TORCH_RPATH "${_tlib}")

add_library(fsdp_torch_c10 SHARED IMPORTED)
set_target_properties(fsdp_torch_c10 PROPERTIES IMPORTED_LOCATION "${_tlib}/libc10.so")
add_library(fsdp_torch_cpu SHARED IMPORTED)
set_target_properties(fsdp_torch_cpu PROPERTIES IMPORTED_LOCATION "${_tlib}/libtorch_cpu.so")

# The wheel's include folder also carries fmt 12 headers; Debian's spdlog is built against
# Debian's fmt 9. A mirror of the folder without fmt/ (symlinks, made at configure time) keeps
# one fmt in every translation unit: Debian's.
set(_tinc "${CMAKE_BINARY_DIR}/torch_include")
if(FSDP_TORCH_INCLUDE_MIRROR)
  set(_tinc "${FSDP_TORCH_INCLUDE_MIRROR}")
endif()
file(GLOB _tentries RELATIVE "${FSDP_TORCH_DIR}/include" "${FSDP_TORCH_DIR}/include/*")
file(REMOVE_RECURSE "${_tinc}")
file(MAKE_DIRECTORY "${_tinc}")
foreach(_e ${_tentries})
  if(NOT _e STREQUAL "fmt")
    file(CREATE_LINK "${FSDP_TORCH_DIR}/include/${_e}" "${_tinc}/${_e}" SYMBOLIC)
  endif()
endforeach()

add_library(fsdp::torch INTERFACE IMPORTED)
target_link_libraries(fsdp::torch INTERFACE fsdp_torch_cpu fsdp_torch_c10)
# The wheel's headers are included as system headers: their warnings are not ours.
target_include_directories(fsdp::torch SYSTEM INTERFACE
  "${_tinc}" "${_tinc}/torch/csrc/api/include")
# USE_C10D_GLOO: ProcessGroupGloo.hpp compiles only with it; gloo's headers come from Debian's
# libgloo-dev (the wheel ships none). USE_DISTRIBUTED: c10d headers expect it.
target_compile_definitions(fsdp::torch INTERFACE
  USE_DISTRIBUTED USE_C10D_GLOO _GLIBCXX_USE_CXX11_ABI=1)

# --- CUDA: only when the toolkit matches the wheel ------------------------------------------
set(FSDP_CUDA_MODE "auto" CACHE STRING "auto | on | off: compile the CUDA/NCCL code paths")
set_property(CACHE FSDP_CUDA_MODE PROPERTY STRINGS auto on off)
set(FSDP_CUDA OFF)
set(_why "")
if(FSDP_CUDA_MODE STREQUAL "off")
  set(_why "FSDP_CUDA_MODE=off")
elseif(NOT FSDP_TORCH_CUDA_VERSION)
  set(_why "the torch wheel is a CPU build")
elseif(NOT EXISTS "${_tlib}/libtorch_cuda.so")
  set(_why "the torch wheel has no libtorch_cuda.so")
else()
  find_package(CUDAToolkit QUIET)
  string(REGEX MATCH "^[0-9]+" _wheel_major "${FSDP_TORCH_CUDA_VERSION}")
  if(NOT CUDAToolkit_FOUND)
    set(_why "no CUDA toolkit found")
  elseif(NOT CUDAToolkit_VERSION_MAJOR STREQUAL _wheel_major)
    set(_why "CUDA toolkit ${CUDAToolkit_VERSION} does not match the wheel's CUDA ${FSDP_TORCH_CUDA_VERSION}")
  else()
    set(FSDP_CUDA ON)
  endif()
endif()
if(FSDP_CUDA_MODE STREQUAL "on" AND NOT FSDP_CUDA)
  message(FATAL_ERROR "FSDP_CUDA_MODE=on but the CUDA build is impossible: ${_why}")
endif()

if(FSDP_CUDA)
  get_filename_component(_nv "${FSDP_TORCH_DIR}/../nvidia" ABSOLUTE)
  # NCCL: the headers that match the libnccl.so.2 libtorch_cuda loads (the wheel's), else the
  # toolkit's.
  find_path(FSDP_NCCL_INCLUDE_DIR nccl.h
    HINTS "${_nv}/nccl/include" ${CUDAToolkit_INCLUDE_DIRS} NO_DEFAULT_PATH)
  if(NOT FSDP_NCCL_INCLUDE_DIR)
    message(FATAL_ERROR "CUDA build: nccl.h not found in ${_nv}/nccl/include or the CUDA toolkit")
  endif()
  file(GLOB _nv_libdirs LIST_DIRECTORIES true "${_nv}/*/lib")
  list(APPEND FSDP_TORCH_RPATH ${_nv_libdirs})

  add_library(fsdp_torch_cuda_lib SHARED IMPORTED)
  set_target_properties(fsdp_torch_cuda_lib PROPERTIES IMPORTED_LOCATION "${_tlib}/libtorch_cuda.so")
  add_library(fsdp_torch_c10_cuda SHARED IMPORTED)
  set_target_properties(fsdp_torch_c10_cuda PROPERTIES IMPORTED_LOCATION "${_tlib}/libc10_cuda.so")

  add_library(fsdp::torch_cuda INTERFACE IMPORTED)
  # --no-as-needed: nothing references libtorch_cuda's symbols directly in a CPU code path, but
  # its static initialisers register the CUDA hooks and the NCCL backend; it must be loaded.
  target_link_libraries(fsdp::torch_cuda INTERFACE
    fsdp::torch
    "-Wl,--no-as-needed" fsdp_torch_cuda_lib fsdp_torch_c10_cuda "-Wl,--as-needed"
    CUDA::cudart)
  target_include_directories(fsdp::torch_cuda SYSTEM INTERFACE
    ${CUDAToolkit_INCLUDE_DIRS} "${FSDP_NCCL_INCLUDE_DIR}")
  target_compile_definitions(fsdp::torch_cuda INTERFACE USE_CUDA USE_C10D_NCCL FSDP_WITH_CUDA=1)
  # Let the linker resolve libtorch_cuda's own dependencies (cuBLAS, NCCL...) from the wheel.
  foreach(_d ${FSDP_TORCH_RPATH})
    target_link_options(fsdp::torch_cuda INTERFACE "-Wl,-rpath-link,${_d}")
  endforeach()
  message(STATUS "fsdp.cpp: CUDA build ON (toolkit ${CUDAToolkit_VERSION}, wheel CUDA "
                 "${FSDP_TORCH_CUDA_VERSION}, nccl.h from ${FSDP_NCCL_INCLUDE_DIR})")
else()
  message(STATUS "fsdp.cpp: CUDA build OFF (${_why}); CPU-only, Gloo backend")
endif()
