# cmake -DIN=<a file under kernels/> -DOUT=<file> -P translate.cmake
# Turns one of the kernels library's files into its emulated copy under
# <build>/tests/cuda_emulation/emulated/kernels/, so that the CUDA code paths run on the CPU
# (tests/cuda_emulation/emulator.h): every file
#  - namespace fsdp::kernels -> fsdp::kernels_emulated (no clash with the real library, which
#    the same test binary links as the reference), and
#  - #include "kernels/..." -> #include "emulated/kernels/..." (the emulated copies);
# the CUDA sources (.cu, .cuh) also
#  - kernel<<<grid, block, shared, stream>>>(args) ->
#    ::fsdp_emu::Launch(kernel, ::fsdp_emu::Config(grid, block, shared, stream))(args);
#  - extern __shared__ T name[]; -> T* name = the block's dynamic shared memory;
#  - __shared__ T name[N]...; -> a static array, poisoned (0xff) at the start of each block;
#  - reinterpret_cast<T>(p) -> ::fsdp_emu::CheckedCast<T>(p), which fails the launch on a
#    pointer not aligned for T (the GPU's misaligned-address fault).
# Everything else (the built-ins and intrinsics) is mapped by prelude.h. Anything left that
# the host compiler cannot take (a launch or __shared__ in another form) stops the build here,
# naming the file.
if(NOT DEFINED IN OR NOT DEFINED OUT)
  message(FATAL_ERROR "usage: cmake -DIN=<file> -DOUT=<file> -P translate.cmake")
endif()
file(READ "${IN}" text)
set(ws "[ \t\r\n]")
set(id "[A-Za-z_][A-Za-z0-9_]*")

string(REPLACE "fsdp::kernels" "fsdp::kernels_emulated" text "${text}")
string(REPLACE "#include \"kernels/" "#include \"emulated/kernels/" text "${text}")
if(IN MATCHES "\\.cuh?$")
  string(REPLACE "reinterpret_cast<" "::fsdp_emu::CheckedCast<" text "${text}")
  string(REGEX REPLACE "(${id}(<[^<>;()]*>)?)${ws}*<<<([^;]*)>>>\\("
         "::fsdp_emu::Launch(\\1, ::fsdp_emu::Config(\\3))(" text "${text}")
  string(REGEX REPLACE "extern${ws}+__shared__${ws}+(${id})${ws}+(${id})${ws}*\\[${ws}*\\]${ws}*;"
         "\\1* \\2 = static_cast<\\1*>(::fsdp_emu::DynamicShared());" text "${text}")
  string(REGEX REPLACE "__shared__${ws}+(${id})${ws}+(${id})((\\[[A-Za-z0-9_ +*/()]*\\])+)${ws}*;"
         "static \\1 \\2\\3; ::fsdp_emu::PoisonShared(\\2, sizeof(\\2));" text "${text}")
  foreach(left "<<<" ">>>" "__shared__")
    string(FIND "${text}" "${left}" at)
    if(NOT at EQUAL -1)
      message(FATAL_ERROR "${IN}: '${left}' in a form tests/cuda_emulation/translate.cmake does "
                          "not translate; extend it (or the kernel's syntax)")
    endif()
  endforeach()
endif()
file(WRITE "${OUT}.tmp" "// Generated from ${IN} by tests/cuda_emulation/translate.cmake.\n${text}")
file(RENAME "${OUT}.tmp" "${OUT}")
