#include "engine/same_config.h"

#include <cstdint>
#include <map>
#include <sstream>

#include <ATen/ATen.h>

#include "common/failure.h"
#include "common/strings.h"

namespace fsdp {

// Note [One configuration on every rank]
// Each rank reads its own config file and --set items: across machines, one per node, so a
// node with a stale copy of the file trains another run. With another training.steps its ranks
// went out of step with the others and hung in a collective until the watchdog's timeout;
// another model shape or strategy fails somewhere inside the engine, far from the cause. So at
// start every rank hashes its resolved configuration (every key, defaults included) and one
// all-reduce (MAX of the hash and of its negation) tells whether all agree. Only if they do
// not, rank 0 publishes its configuration in the store and each rank compares its own with it:
// a rank that differs stops as a config error naming each key with both values, the others as
// peer lost (so the launcher's headline is the rank that differs), except rank 0 when most ranks
// differ from it: then it is the odd one, and says so. Paths that may name node-local copies
// of one file (data.path, model.init_from, training.profile_dir) are not compared; run.dir and
// checkpoint.dir are: every rank writes its shards into the one checkpoint folder.

std::vector<std::string> ConfigKeyLines(const std::string& yaml) {
  std::vector<std::string> lines;
  std::istringstream in(yaml);
  std::string section;
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    if (line[0] != ' ') {  // "section:"
      section = line.substr(0, line.find(':'));
      continue;
    }
    const size_t start = line.find_first_not_of(' ');
    if (start == std::string::npos) continue;
    lines.push_back(StrCat(section, ".", line.substr(start)));
  }
  return lines;
}

namespace {

std::map<std::string, std::string> ByKey(const std::vector<std::string>& lines) {
  std::map<std::string, std::string> out;
  for (const std::string& line : lines) {
    const size_t colon = line.find(": ");
    if (colon == std::string::npos) {
      out[line] = "";
    } else {
      out[line.substr(0, colon)] = line.substr(colon + 2);
    }
  }
  return out;
}

// FNV-1a: the same on every machine (std::hash need not be).
int64_t Fingerprint(const std::vector<std::string>& lines) {
  uint64_t h = 14695981039346656037ull;
  for (const std::string& line : lines) {
    for (char c : line) {
      h ^= static_cast<unsigned char>(c);
      h *= 1099511628211ull;
    }
    h ^= '\n';
    h *= 1099511628211ull;
  }
  return static_cast<int64_t>(h >> 1);  // its negation fits too
}

}  // namespace

std::vector<std::string> ConfigDifferences(const std::vector<std::string>& mine,
                                           const std::vector<std::string>& theirs,
                                           int their_rank) {
  const std::map<std::string, std::string> a = ByKey(mine), b = ByKey(theirs);
  std::vector<std::string> out;
  auto describe = [](const std::map<std::string, std::string>& m, const std::string& key) {
    auto it = m.find(key);
    return it == m.end() ? std::string("(no such key)") : it->second;
  };
  std::map<std::string, bool> keys;
  for (const auto& [k, v] : a) keys[k] = true;
  for (const auto& [k, v] : b) keys[k] = true;
  for (const auto& [key, unused] : keys) {
    const std::string here = describe(a, key), there = describe(b, key);
    if (here != there) {
      out.push_back(StrCat(key, ": ", here, " here, ", there, " on rank ", their_rank));
    }
  }
  return out;
}

absl::Status CheckSameConfigOnEveryRank(const RunConfig& config, DistContext& ctx,
                                        c10::Device device) {
  ProcessGroup& world = ctx.world();
  if (world.size() == 1) return absl::OkStatus();
  std::vector<std::string> lines;
  for (std::string& line : ConfigKeyLines(config.ToYaml())) {
    if (StartsWith(line, "data.path: ") || StartsWith(line, "model.init_from: ") ||
        StartsWith(line, "training.profile_dir: ")) {
      continue;  // may name node-local copies
    }
    lines.push_back(std::move(line));
  }
  const int64_t h = Fingerprint(lines);
  at::Tensor t = at::tensor({h, -h}, at::TensorOptions().dtype(at::kLong)).to(device);
  world.AllReduce(t, c10d::ReduceOp::MAX)->wait();
  const at::Tensor host = t.cpu();
  if (host[0].item<int64_t>() == -host[1].item<int64_t>()) return absl::OkStatus();

  // They differ: compare with rank 0's (a key of its own per context made in this process).
  static int checks = 0;
  const std::string key = StrCat("fsdp/run_config/", checks++);
  const c10::intrusive_ptr<c10d::Store>& store = ctx.store();
  std::string joined;
  for (const std::string& line : lines) joined += line + "\n";
  std::vector<std::string> theirs;
  try {
    if (ctx.rank() == 0) {
      store->set(key, std::vector<uint8_t>(joined.begin(), joined.end()));
    } else {
      const std::vector<uint8_t> bytes = store->get(key);
      std::istringstream in(std::string(bytes.begin(), bytes.end()));
      for (std::string line; std::getline(in, line);) theirs.push_back(line);
    }
  } catch (const std::exception& e) {
    return WithFailureClass(
        absl::UnavailableError(StrCat("the ranks' configurations differ, and rank 0's could not "
                                      "be read from the store: ", e.what())),
        FailureClass::kPeerLost);
  }
  // Rank 0 may host the store: it leaves only once every rank has read its configuration.
  world.Barrier()->wait();
  const std::vector<std::string> diff =
      ctx.rank() == 0 ? std::vector<std::string>{} : ConfigDifferences(lines, theirs, 0);
  at::Tensor differing = at::full({1}, diff.empty() ? 0 : 1, at::TensorOptions().dtype(at::kLong))
                             .to(device);
  world.AllReduce(differing)->wait();
  const int64_t others = differing.cpu().item<int64_t>();
  // With two ranks neither is the odd one: the one that differs from rank 0 names the keys.
  if (ctx.rank() == 0 && others >= 2 && 2 * others > world.size() - 1) {
    return WithFailureClass(
        absl::InvalidArgumentError(StrCat(
            config.source_file, ": rank 0's configuration differs from most ranks' (", others,
            " of the other ", world.size() - 1, " differ from it; their errors name the keys): "
            "every rank must run the same configuration, the same config file and --set items "
            "on every node")),
        FailureClass::kConfig);
  }
  if (diff.empty()) {
    return WithFailureClass(
        absl::FailedPreconditionError(
            "another rank's configuration differs from rank 0's (that rank's error names the "
            "keys); every rank must run the same configuration"),
        FailureClass::kPeerLost);
  }
  return WithFailureClass(
      absl::InvalidArgumentError(StrCat(
          config.source_file, ": this rank's configuration differs from rank 0's: ",
          StrJoin(diff, "; "),
          " (every rank must run the same configuration: the same config file and --set items "
          "on every node)")),
      FailureClass::kConfig);
}

}  // namespace fsdp
