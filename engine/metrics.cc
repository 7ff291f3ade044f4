#include "engine/metrics.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>

#include <fmt/format.h>

#include "common/strings.h"

namespace fsdp {

absl::StatusOr<MetricsWriter> MetricsWriter::Open(const std::string& path, int64_t resume_step) {
  std::string kept;
  if (resume_step >= 0) {
    std::ifstream in(path);
    for (std::string line; std::getline(in, line);) {
      nlohmann::json record = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (record.is_object() && record.contains("step") && record["step"].is_number_integer() &&
          record["step"].get<int64_t>() <= resume_step) {
        kept += line + "\n";
      }
    }
  }
  MetricsWriter writer;
  writer.path_ = path;
  writer.file_ = std::fopen(path.c_str(), "w");
  if (writer.file_ == nullptr) {
    return absl::FailedPreconditionError(
        StrCat("cannot write metrics file '", path, "': ", std::strerror(errno)));
  }
  if (!kept.empty() && (std::fwrite(kept.data(), 1, kept.size(), writer.file_) != kept.size() ||
                        std::fflush(writer.file_) != 0)) {
    return absl::FailedPreconditionError(
        StrCat("cannot write metrics file '", path, "': ", std::strerror(errno)));
  }
  return writer;
}

MetricsWriter::MetricsWriter(MetricsWriter&& other) noexcept
    : path_(std::move(other.path_)), file_(other.file_), status_(std::move(other.status_)) {
  other.file_ = nullptr;
}

MetricsWriter::~MetricsWriter() {
  if (file_ != nullptr) std::fclose(file_);
}

void MetricsWriter::Write(const nlohmann::json& record) {
  if (file_ == nullptr || !status_.ok()) return;
  std::string line = record.dump() + "\n";
  if (std::fwrite(line.data(), 1, line.size(), file_) != line.size() || std::fflush(file_) != 0) {
    status_ = absl::ResourceExhaustedError(StrCat("writing metrics file '", path_, "' failed: ",
                                                  std::strerror(errno),
                                                  "; stopping (free space, or metrics.jsonl: false)"));
  }
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
