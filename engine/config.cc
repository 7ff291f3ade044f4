#include "engine/config.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string_view>
#include <variant>

#include "common/status.h"
#include "common/strings.h"
#include "common/yaml_schema.h"
#include "engine/config_validate.h"
#include "engine/hf_llama.h"
#include "engine/run_schema.h"
#include "sharding/options.h"

namespace fsdp {

std::string RunConfig::ToYaml() const {
  RunConfig copy = *this;
  std::string out = StrCat("# Resolved run configuration",
                           source_file.empty() ? "" : StrCat(" (from ", source_file, ")"), "\n");
  for (const Section& section : RunSections(copy)) {
    out += StrCat("\n", section.name, ":\n");
    for (const Field& field : section.fields) {
      out += StrCat("  ", field.name, ": ", YamlScalar(field.ref), "\n");
    }
  }
  return out;
}

std::string RunConfig::Value(std::string_view key) const {
  RunConfig copy = *this;
  for (const Section& section : RunSections(copy)) {
    for (const Field& field : section.fields) {
      if (StrCat(section.name, ".", field.name) != key) continue;
      if (auto* choice = std::get_if<ChoiceField>(&field.ref)) return choice->print();
      if (auto* text = std::get_if<std::string*>(&field.ref)) return **text;
      return YamlScalar(field.ref);
    }
  }
  return "";
}

absl::StatusOr<RunConfig> ParseRunConfig(const std::string& yaml_text, const std::string& name,
                                         const std::vector<std::string>& overrides) {
  RunConfig config;
  config.source_file = name;
  Locations where;
  Parser parser(name, RunSections(config), RemovedRunKeys(), std::string(kRunDocument));
  FSDP_RETURN_IF_ERROR(parser.ParseDocument(yaml_text, where));
  for (const std::string& item : overrides) {
    FSDP_RETURN_IF_ERROR(parser.ApplyOverride(item, where));
  }
  if (IsHfCheckpointDir(config.model.init_from)) {  // the shape comes from its config.json
    FSDP_RETURN_IF_ERROR(ApplyHfLlamaConfig(
        config.model.init_from,
        [&](const std::string& key) {
          auto it = where.find(key);
          return it == where.end() ? std::string() : it->second;
        },
        config.model));
  }
  FSDP_RETURN_IF_ERROR(ValidateRunConfig(config, where));
  config.locations = std::move(where);
  return config;
}

std::string RunConfig::Where(std::string_view key) const {
  if (auto it = locations.find(key); it != locations.end()) return it->second;
  return source_file;
}

namespace {

// What a path that is not a regular file is, for the message.
const char* FileKind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "a special file";
}

}  // namespace

absl::StatusOr<RunConfig> LoadRunConfig(const std::string& path,
                                        const std::vector<std::string>& overrides) {
  // Only a regular file is read: a FIFO would block the command until someone writes to it,
  // /dev/zero would never end. stat() first for the message; the open does not wait for a
  // FIFO's writer (O_NONBLOCK) and fstat() checks again what was opened.
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    if (errno == ENOENT || errno == ENOTDIR) {
      return absl::NotFoundError(StrCat(path, ": no such config file"));
    }
    return absl::InvalidArgumentError(StrCat(path, ": cannot read: ", std::strerror(errno)));
  }
  auto not_regular = [&](mode_t mode) {
    return absl::InvalidArgumentError(StrCat(path, ": is ", FileKind(mode), ", not a YAML file"));
  };
  if (!S_ISREG(st.st_mode)) return not_regular(st.st_mode);
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    return absl::InvalidArgumentError(
        StrCat(path, ": cannot open the file: ", std::strerror(errno)));
  }
  struct CloseFd {
    int fd;
    ~CloseFd() { ::close(fd); }
  } close_fd{fd};
  if (::fstat(fd, &st) != 0) {
    return absl::InvalidArgumentError(StrCat(path, ": cannot read: ", std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) return not_regular(st.st_mode);
  std::string text;
  char buffer[1 << 16];
  while (true) {
    const ssize_t n = ::read(fd, buffer, sizeof(buffer));
    if (n == 0) break;
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::InvalidArgumentError(StrCat(path, ": cannot read: ", std::strerror(errno)));
    }
    text.append(buffer, static_cast<size_t>(n));
  }
  return ParseRunConfig(text, path, overrides);
}

std::pair<int, int> ParallelismSection::MeshDegrees(int world_size) const {
  int replicate = static_cast<int>(data_parallel_replicate_degree);
  int shard = static_cast<int>(data_parallel_shard_degree);
  if (replicate == -1) replicate = world_size / shard;
  if (shard == -1) shard = world_size / replicate;
  return {replicate, shard};
}

c10::ScalarType ScalarTypeOf(Precision precision) {
  return precision == Precision::kBf16 ? c10::kBFloat16 : c10::kFloat;
}
int BytesOf(Precision precision) { return precision == Precision::kBf16 ? 2 : 4; }
const char* PrecisionName(Precision precision) { return PrecisionNames().Name(precision); }
const char* DeviceKindName(DeviceKind device) { return DeviceKindNames().Name(device); }
const char* CudaBackendName(CudaBackend backend) { return CudaBackendNames().Name(backend); }
const char* CpuCollectivesName(CpuCollectives collectives) {
  return CpuCollectivesNames().Name(collectives);
}
const char* StrategyLabel(const std::optional<Strategy>& strategy) {
  return StrategyNames().Name(strategy);
}

}  // namespace fsdp
