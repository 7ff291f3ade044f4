// libFuzzer harness for the safetensors reader (checkpoint/safetensors.h): each input is written
// to a file and opened with SafetensorsFile::Open. A rejected input must come back as a non-OK
// status. An accepted one promises every tensor is readable (Note [Safetensors spec]), so for
// each entry: the whole tensor reads OK with exactly the bytes at its data_offsets, rows
// [1, d0) read OK too, and out-of-range rows and unknown names fail with a status.
// Anything else is a finding (fuzz_util.h).
//
//   build/fuzz/sanitized/fsdp_fuzz_safetensors -timeout=1 CORPUS build/fuzz/seeds/safetensors
#include <cstdint>
#include <cstring>
#include <string>

#include <ATen/ATen.h>

#include "checkpoint/safetensors.h"
#include "fuzz/fuzz_util.h"

namespace {

using fsdp::ckpt::SafetensorsFile;
using fsdp::fuzz::Expect;

const std::string* g_path = nullptr;

// The bytes `out` holds must be the file's bytes [offset, offset + out.nbytes()).
void ExpectBytes(const at::Tensor& out, const uint8_t* data, size_t size, int64_t offset,
                 const std::string& what) {
  const size_t n = out.nbytes();
  Expect(offset >= 0 && static_cast<size_t>(offset) + n <= size, what + ": read past the input");
  Expect(n == 0 || std::memcmp(out.data_ptr(), data + offset, n) == 0,
         what + ": bytes differ from the file's");
}

void CheckEntry(const SafetensorsFile& file, const std::string& name,
                const SafetensorsFile::Entry& entry, const uint8_t* data, size_t size,
                int64_t data_start) {
  const bool scalar = entry.shape.empty();
  const int64_t rows = scalar ? 1 : entry.shape[0];
  const int64_t nbytes = entry.end - entry.begin;
  at::Tensor out;
  absl::Status s = file.ReadRows(name, 0, rows, out);
  Expect(s.ok(), "Open accepted tensor '" + name + "' but reading all its rows failed", s);
  Expect(static_cast<int64_t>(out.nbytes()) == nbytes,
         "tensor '" + name + "': read " + std::to_string(out.nbytes()) + " bytes, data_offsets hold " +
             std::to_string(nbytes));
  Expect(scalar ? out.dim() == 0 : out.sizes().vec() == entry.shape,
         "tensor '" + name + "': read shape differs from the header's");
  ExpectBytes(out, data, size, data_start + entry.begin, "tensor '" + name + "'");
  if (rows >= 2) {
    s = file.ReadRows(name, 1, rows, out);
    Expect(s.ok(), "tensor '" + name + "': reading rows [1, d0) failed", s);
    ExpectBytes(out, data, size, data_start + entry.begin + nbytes / rows,
                "tensor '" + name + "' rows [1, d0)");
  }
  s = file.ReadRows(name, 0, 0, out);
  Expect(s.ok() && out.numel() == 0, "tensor '" + name + "': reading no rows failed", s);
  Expect(!file.ReadRows(name, rows, rows + 1, out).ok(), "rows past the end read OK");
  Expect(!file.ReadRows(name, -1, 0, out).ok(), "negative rows read OK");
  Expect(!file.ReadRows(name, 1, 0, out).ok(), "a reversed row range read OK");
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  g_path = new std::string(fsdp::fuzz::ScratchDir("safetensors") + "/input.safetensors");
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fsdp::fuzz::WriteInput(*g_path, data, size);
  fsdp::fuzz::Run([&] {
    absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(*g_path);
    if (!file.ok()) return;  // rejected with a status: fine
    uint64_t header_length = 0;
    Expect(size >= 8, "Open accepted a file shorter than the header length");
    std::memcpy(&header_length, data, 8);
    const int64_t data_start = 8 + static_cast<int64_t>(header_length);
    for (const auto& [name, entry] : file->entries()) {
      CheckEntry(*file, name, entry, data, size, data_start);
    }
    at::Tensor out;
    if (file->entries().count("\x01no such tensor") == 0) {
      Expect(file->ReadRows("\x01no such tensor", 0, 0, out).code() == absl::StatusCode::kNotFound,
             "an unknown tensor was not kNotFound");
    }
  });
  return 0;
}
