#include "engine/metrics.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "common/strings.h"

namespace fsdp {

absl::StatusOr<MetricsWriter> MetricsWriter::Open(const std::string& path, bool append) {
  MetricsWriter writer;
  writer.file_ = std::fopen(path.c_str(), append ? "a" : "w");
  if (writer.file_ == nullptr) {
    return absl::FailedPreconditionError(StrCat("cannot write metrics file '", path, "'"));
  }
  return writer;
}

MetricsWriter::MetricsWriter(MetricsWriter&& other) noexcept : file_(other.file_) {
  other.file_ = nullptr;
}

MetricsWriter::~MetricsWriter() {
  if (file_ != nullptr) std::fclose(file_);
}

void MetricsWriter::Write(const nlohmann::json& record) {
  if (file_ == nullptr) return;
  std::string line = record.dump() + "\n";
  std::fwrite(line.data(), 1, line.size(), file_);
  std::fflush(file_);
}

double PeakFlopsPerDevice(const std::string& name, bool bf16) {
  // Dense (no sparsity) peaks from the vendors' data sheets; TF32 for fp32 compute.
  struct Entry {
    const char* match;
    double bf16, tf32;
  };
  static const Entry kTable[] = {
      {"H200", 989e12, 494e12},     {"H100 PCIe", 756e12, 378e12}, {"H100", 989e12, 494e12},
      {"GH200", 989e12, 494e12},    {"B200", 2250e12, 1100e12},   {"A100", 312e12, 156e12},
      {"A800", 312e12, 156e12},     {"L40S", 362e12, 183e12},     {"L4", 121e12, 60e12},
      {"A10", 125e12, 62.5e12},     {"V100", 125e12, 15.7e12},    {"4090", 165e12, 82.6e12},
  };
  for (const Entry& e : kTable) {
    if (name.find(e.match) != std::string::npos) return bf16 ? e.bf16 : e.tf32;
  }
  return 0;
}

std::string ProgressBar(int64_t done, int64_t total, double seconds_per_step, int width) {
  double frac = total > 0 ? std::clamp(static_cast<double>(done) / total, 0.0, 1.0) : 1.0;
  int filled = static_cast<int>(frac * width);
  int64_t eta = static_cast<int64_t>(std::max<int64_t>(0, total - done) * seconds_per_step);
  return fmt::format("[{}{}] {}/{} {:3.0f}% ETA {}:{:02d}", std::string(filled, '#'),
                     std::string(width - filled, '.'), done, total, 100 * frac, eta / 60,
                     eta % 60);
}

std::string HumanBytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024 && u < 4) {
    bytes /= 1024;
    ++u;
  }
  return fmt::format("{:.1f} {}", bytes, units[u]);
}

}  // namespace fsdp
