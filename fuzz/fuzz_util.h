// Shared by the libFuzzer harnesses (safetensors_fuzzer.cc, metadata_fuzzer.cc): a scratch
// folder for the inputs (the parsers take paths), writing one input, and reporting a finding.
//
// A finding is anything but "opened, and every read succeeded or failed with a status" or
// "rejected with a status": a crash or sanitizer report (the build aborts on the first one,
// -fno-sanitize-recover=all), an exception escaping a boundary function, an input that hangs
// (libFuzzer's -timeout), or a broken promise checked here with Expect (e.g. a file Open
// accepted whose tensor then cannot be read). Expect prints "fsdp fuzz: FINDING: ..." and
// aborts, so libFuzzer saves the input as crash-<sha1>.
//
//   std::string dir = fsdp::fuzz::ScratchDir("safetensors");
//   fsdp::fuzz::WriteInput(dir + "/input", data, size);
//   fsdp::fuzz::Run([&] { fsdp::fuzz::Expect(status.ok(), "full read", status); });
#pragma once

#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <string>

#include "absl/status/status.h"

namespace fsdp::fuzz {

[[noreturn]] inline void Finding(const std::string& what) {
  std::fprintf(stderr, "fsdp fuzz: FINDING: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

inline void Expect(bool ok, const std::string& what, const absl::Status& status = {}) {
  if (!ok) Finding(what + (status.ok() ? "" : " (status: " + status.ToString() + ")"));
}

// Runs one input's checks; an exception reaching here escaped the parser.
template <typename F>
void Run(F&& body) {
  try {
    body();
  } catch (const std::exception& e) {
    Finding(std::string("exception escaped: ") + e.what());
  } catch (...) {
    Finding("exception of unknown type escaped");
  }
}

// A fresh folder for this process's inputs: $FSDP_FUZZ_SCRATCH if set, else under /dev/shm
// (no disk writes per execution) or $TMPDIR. Removed at a normal exit (not after a finding:
// the input is in libFuzzer's crash file anyway).
inline std::string ScratchDir(const char* name) {
  std::string base;
  if (const char* s = std::getenv("FSDP_FUZZ_SCRATCH"); s && *s) {
    base = s;
  } else if (::access("/dev/shm", W_OK) == 0) {
    base = "/dev/shm";
  } else {
    const char* t = std::getenv("TMPDIR");
    base = t && *t ? t : "/tmp";
  }
  std::filesystem::create_directories(base);
  std::string templ = base + "/fsdp_fuzz_" + name + "_XXXXXX";
  if (::mkdtemp(templ.data()) == nullptr) Finding("cannot create a scratch folder under " + base);
  static std::string* dir = new std::string(templ);  // outlives atexit
  *dir = templ;
  std::atexit([] {
    std::error_code ec;
    std::filesystem::remove_all(*dir, ec);
  });
  return templ;
}

// Replaces `path` with exactly `data` (a harness problem, not a finding, aborts if it cannot).
inline void WriteInput(const std::string& path, const void* data, size_t size) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) Finding("harness: cannot write " + path);
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    ssize_t n = ::write(fd, p, size);
    if (n <= 0) Finding("harness: short write to " + path);
    p += n;
    size -= static_cast<size_t>(n);
  }
  ::close(fd);
}

}  // namespace fsdp::fuzz
