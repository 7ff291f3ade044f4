// DeviceMesh and rendezvous on real processes over Gloo: 1-D, 2-D and 3-D meshes, world sizes
// that are not powers of two, collectives on every axis with exact expected values, and the
// failures a user meets (missing rank, duplicate rank, mismatched WORLD_SIZE, busy port).
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <numeric>
#include <thread>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "common/strings.h"
#include "device_mesh/device_mesh.h"
#include "tests/multirank.h"

namespace fsdp {
namespace {

using ::testing::HasSubstr;
using testing::InitDist;
using testing::MultiRankOptions;
using ::testing::Not;
using testing::RunOnRanks;
using testing::TestDistOptions;

std::string Message(const absl::Status& s) { return std::string(s.message()); }

// Every collective on every axis, against values computed from the global ranks.
void CheckEveryAxis(const DeviceMesh& mesh) {
  const int me = mesh.rank();
  for (int axis = 0; axis < mesh.ndim(); ++axis) {
    SCOPED_TRACE("axis " + mesh.shape().axis_names[axis]);
    ProcessGroup& group = mesh.group(axis);
    const std::vector<int>& ranks = group.global_ranks();
    const int n = group.size();
    ASSERT_EQ(ranks, AxisGroupRanks(mesh.shape(), me, axis));
    ASSERT_EQ(n, mesh.size(axis));
    ASSERT_EQ(group.rank(), mesh.coord(axis));
    ASSERT_EQ(ranks[group.rank()], me);
    const double rank_sum = std::accumulate(ranks.begin(), ranks.end(), 0.0) + n;

    at::Tensor sum = at::full({7}, me + 1.0);
    group.AllReduce(sum)->wait();
    EXPECT_TRUE(sum.eq(rank_sum).all().item<bool>()) << sum;

    at::Tensor max = at::full({3}, static_cast<double>(me));
    group.AllReduce(max, c10d::ReduceOp::MAX)->wait();
    EXPECT_EQ(max[0].item<float>(), *std::max_element(ranks.begin(), ranks.end()));

    at::Tensor mine = at::tensor({me * 10.0f, me * 10.0f + 1});
    at::Tensor gathered = at::empty({2 * n});
    group.AllGatherInto(gathered, mine)->wait();
    for (int g = 0; g < n; ++g) {
      EXPECT_EQ(gathered[2 * g].item<float>(), ranks[g] * 10.0f);
      EXPECT_EQ(gathered[2 * g + 1].item<float>(), ranks[g] * 10.0f + 1);
    }

    // Chunk j of every rank's input holds (rank+1)*(j+1); group rank j receives the sum.
    at::Tensor input = at::arange(1, n + 1, at::kFloat).repeat_interleave(3).mul(me + 1);
    at::Tensor output = at::empty({3});
    group.ReduceScatter(output, input)->wait();
    EXPECT_TRUE(output.eq(rank_sum * (group.rank() + 1)).all().item<bool>()) << output;

    at::Tensor bcast = at::full({4}, static_cast<double>(me));
    group.Broadcast(bcast, n - 1)->wait();
    EXPECT_TRUE(bcast.eq(ranks[n - 1]).all().item<bool>()) << bcast;
  }
  mesh.context().world().Barrier()->wait();
}

struct MeshCase {
  int world_size;
  std::string spec;
  std::vector<int> degrees;
};

class MeshTest : public ::testing::TestWithParam<MeshCase> {};

TEST_P(MeshTest, CoordinatesGroupsAndCollectivesOnEveryAxis) {
  const MeshCase c = GetParam();
  RunOnRanks(c.world_size, [&](int rank) {
    std::shared_ptr<DistContext> ctx = InitDist();
    ASSERT_EQ(ctx->rank(), rank);
    ASSERT_EQ(ctx->world_size(), c.world_size);
    absl::StatusOr<MeshShape> shape = ParseMeshSpec(c.spec, c.world_size);
    ASSERT_TRUE(shape.ok()) << shape.status();
    ASSERT_EQ(shape->degrees, c.degrees);
    absl::StatusOr<DeviceMesh> mesh = DeviceMesh::Create(ctx, *shape);
    ASSERT_TRUE(mesh.ok()) << mesh.status();
    EXPECT_EQ(mesh->coords(), RankToCoords(*shape, rank));
    CheckEveryAxis(*mesh);
  });
}

INSTANTIATE_TEST_SUITE_P(
    Meshes, MeshTest,
    ::testing::Values(MeshCase{1, "", {1}}, MeshCase{2, "2", {2}}, MeshCase{3, "", {3}},
                      MeshCase{4, "4", {4}}, MeshCase{4, "replicate=2,shard=2", {2, 2}},
                      MeshCase{4, "replicate=4,shard=1", {4, 1}},
                      MeshCase{6, "replicate=3,shard=-1", {3, 2}},
                      MeshCase{6, "2x3", {2, 3}}, MeshCase{6, "3,1,2", {3, 1, 2}},
                      MeshCase{8, "2,2,2", {2, 2, 2}}),
    [](const ::testing::TestParamInfo<MeshCase>& info) {
      std::string name = "World" + std::to_string(info.param.world_size) + "_Mesh";
      for (int d : info.param.degrees) name += "_" + std::to_string(d);
      return name;
    });

TEST(DeviceMeshMultiRank, HsdpGroupsAreShardInsideReplicaAcross) {
  RunOnRanks(4, [](int rank) {
    std::shared_ptr<DistContext> ctx = InitDist();
    absl::StatusOr<DeviceMesh> mesh = DeviceMesh::Create(ctx, *ParseMeshSpec("2,2", 4));
    ASSERT_TRUE(mesh.ok()) << mesh.status();
    const std::vector<std::vector<int>> shard = {{0, 1}, {0, 1}, {2, 3}, {2, 3}};
    const std::vector<std::vector<int>> replicate = {{0, 2}, {1, 3}, {0, 2}, {1, 3}};
    EXPECT_EQ((*mesh->group("shard"))->global_ranks(), shard[rank]);
    EXPECT_EQ((*mesh->group("replicate"))->global_ranks(), replicate[rank]);
    absl::StatusOr<ProcessGroup*> missing = mesh->group("tensor");
    EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
    EXPECT_THAT(Message(missing.status()), HasSubstr("axes: replicate, shard"));
  });
}

// Note [A group is created when every member has created it]: ranks that end right after
// creating their groups. Without the store barrier at the end of ProcessGroup::Create, a peer
// still inside Gloo's connect saw the socket close and failed ("Connection closed by peer"),
// in about one of twenty such runs on a 2-core machine (six ranks, each in five 2-rank groups).
TEST(DeviceMeshMultiRank, RanksThatEndRightAfterCreatingGroupsDoNotFailTheirPeers) {
  constexpr int kWorld = 6;
  for (int run = 0; run < 3; ++run) {
    SCOPED_TRACE("run " + std::to_string(run));
    RunOnRanks(kWorld, [](int rank) {
      std::shared_ptr<DistContext> ctx = InitDist();
      for (int a = 0; a < kWorld; ++a) {
        for (int b = a + 1; b < kWorld; ++b) {
          if (rank != a && rank != b) continue;
          absl::StatusOr<std::shared_ptr<ProcessGroup>> group = ctx->NewGroup({a, b}, "pair");
          ASSERT_TRUE(group.ok()) << group.status();
        }
      }
      // Gone at once: no destructor, no barrier of the harness's, sockets closed by the kernel.
      std::fflush(nullptr);
      _exit(0);
    });
  }
}

// The barrier itself, on an in-process store: it waits for every member, and one that never
// arrives is named.
TEST(ProcessGroupCreate, WaitsForEveryMemberAndNamesTheOnesThatNeverCame) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  const std::vector<int> members = {0, 3, 5};
  std::vector<absl::Status> results(members.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < members.size(); ++i) {
    threads.emplace_back([&, i] {
      results[i] = WaitForGroupMembers(*store, "g/all", members, members[i],
                                       std::chrono::seconds(30));
    });
  }
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : results) EXPECT_TRUE(s.ok()) << s;

  threads.clear();
  results.assign(2, absl::OkStatus());
  for (int i : {0, 1}) {  // ranks 0 and 3 of [0, 3, 5]; 5 never calls
    threads.emplace_back([&, i] {
      results[i] = WaitForGroupMembers(*store, "g/partial", members, members[i],
                                       std::chrono::milliseconds(300));
    });
  }
  for (std::thread& t : threads) t.join();
  for (int i : {0, 1}) {
    EXPECT_EQ(results[i].code(), absl::StatusCode::kDeadlineExceeded) << results[i];
    EXPECT_THAT(Message(results[i]), HasSubstr("'g/partial' [0, 3, 5] on rank " +
                                               std::to_string(members[i])));
    EXPECT_THAT(Message(results[i]), HasSubstr("rank(s) 5 did not finish creating it within "
                                               "300 ms"));
  }
}

TEST(DeviceMeshMultiRank, SeveralMeshesInOneJob) {
  RunOnRanks(4, [](int rank) {
    std::shared_ptr<DistContext> ctx = InitDist();
    for (const char* spec : {"4", "2,2", "1,4", "replicate=2,shard=-1"}) {
      absl::StatusOr<DeviceMesh> mesh = DeviceMesh::Create(ctx, *ParseMeshSpec(spec, 4));
      ASSERT_TRUE(mesh.ok()) << spec << ": " << mesh.status();
      CheckEveryAxis(*mesh);
    }
  });
}

// Note [Collectives over Gloo's point-to-point transport]: the p2p all-gather and ring
// reduce-scatter against c10d's Gloo collectives on the same random data, with chunks of
// several ring segments and an odd tail, several collectives in flight at once, and the input
// left as it was.
TEST(DeviceMeshMultiRank, P2pCollectivesMatchGlooOnLargeUnevenBuffers) {
  for (int world : {2, 3, 4}) {
    SCOPED_TRACE("world " + std::to_string(world));
    RunOnRanks(world, [world](int rank) {
      std::shared_ptr<DistContext> p2p_ctx = InitDist();
      DistOptions gloo_options = TestDistOptions();
      gloo_options.cpu_collectives = "gloo";
      std::shared_ptr<DistContext> gloo_ctx = InitDist(gloo_options);
      const int64_t seg = P2pCollectives::kSegmentBytes / 4;
      for (int64_t chunk : {int64_t{1}, 2 * seg + 77, 5 * seg}) {
        SCOPED_TRACE("chunk " + std::to_string(chunk));
        std::vector<at::Tensor> inputs, outputs, works_in;
        std::vector<c10::intrusive_ptr<c10d::Work>> works;
        for (int k = 0; k < 3; ++k) {  // three reduce-scatters in flight
          at::manual_seed(1000 * rank + k);
          inputs.push_back(at::randn({chunk * world}));
          works_in.push_back(inputs.back().clone());
          outputs.push_back(at::empty({chunk}));
          works.push_back(p2p_ctx->world().ReduceScatter(outputs.back(), works_in.back()));
        }
        at::Tensor gathered = at::empty({chunk * world});
        at::Tensor mine = inputs[0].narrow(0, 0, chunk).contiguous();
        works.push_back(p2p_ctx->world().AllGatherInto(gathered, mine));
        for (auto& w : works) w->wait();
        for (int k = 0; k < 3; ++k) {
          at::Tensor expected = at::empty({chunk});
          at::Tensor in = inputs[k].clone();
          gloo_ctx->world().ReduceScatter(expected, in)->wait();
          EXPECT_TRUE(at::allclose(outputs[k], expected, 1e-5, 1e-5)) << "reduce-scatter " << k;
          EXPECT_TRUE(works_in[k].equal(inputs[k])) << "the input was modified";
        }
        at::Tensor expected = at::empty({chunk * world});
        gloo_ctx->world().AllGatherInto(expected, mine)->wait();
        EXPECT_TRUE(gathered.equal(expected));
      }
    });
  }
}

// A peer that is gone fails the p2p collective (and the ones queued behind it) with the
// group's name instead of hanging.
TEST(DeviceMeshMultiRank, P2pCollectiveFailsWhenAPeerIsGone) {
  RunOnRanks(2, [](int rank) {
    std::shared_ptr<DistContext> ctx = InitDist();
    at::Tensor in = at::ones({1 << 20});
    at::Tensor out = at::empty({1 << 19});
    ctx->world().ReduceScatter(out, in)->wait();  // both connected
    if (rank == 1) std::_Exit(0);
    auto first = ctx->world().ReduceScatter(out, in);
    auto second = ctx->world().AllGatherInto(in, out);
    for (auto* work : {&first, &second}) {
      try {
        (*work)->wait();
        ADD_FAILURE() << "a collective with a dead peer completed";
      } catch (const std::exception& e) {
        EXPECT_THAT(e.what(), HasSubstr("collective on group 'fsdp/"));
      }
    }
  });
}

TEST(DeviceMeshMultiRank, MeshThatDoesNotMatchTheWorldIsRejected) {
  RunOnRanks(2, [](int rank) {
    std::shared_ptr<DistContext> ctx = InitDist();
    absl::StatusOr<DeviceMesh> mesh = DeviceMesh::Create(ctx, MeshShape{{"replicate", "shard"}, {2, 2}});
    ASSERT_FALSE(mesh.ok());
    EXPECT_EQ(mesh.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(Message(mesh.status()), HasSubstr("2 x 2 = 4 ranks but the world size is 2"));
  });
}

TEST(RendezvousMultiRank, MissingRankTimesOutNamingIt) {
  RunOnRanks(4, [](int rank) {
    if (rank == 3) return;  // never arrives
    DistOptions options = testing::TestDistOptions();
    options.rendezvous_timeout = std::chrono::seconds(2);
    auto start = std::chrono::steady_clock::now();
    absl::StatusOr<std::shared_ptr<DistContext>> ctx = DistContext::InitFromEnvironment(options);
    double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ASSERT_FALSE(ctx.ok());
    EXPECT_EQ(ctx.status().code(), absl::StatusCode::kDeadlineExceeded) << ctx.status();
    EXPECT_THAT(Message(ctx.status()), HasSubstr("3 of 4 ranks arrived"));
    EXPECT_THAT(Message(ctx.status()), HasSubstr("still waiting for rank(s) 3"));
    EXPECT_THAT(Message(ctx.status()), HasSubstr("timed out after 2 s"));
    EXPECT_THAT(Message(ctx.status()), Not(HasSubstr(StrCat("rank ", rank, ":"))));
    // It fails at the timeout, not much later (generous bound for a loaded 2-core machine).
    EXPECT_LT(waited, 10.0);
  });
}

TEST(RendezvousMultiRank, TwoProcessesClaimingOneRank) {
  MultiRankOptions options;
  options.style = testing::EnvStyle::kPlain;
  options.rank_env = [](int rank) -> std::map<std::string, std::string> {
    return {{"RANK", "0"}};  // both say RANK=0; the store's host is whichever binds first
  };
  RunOnRanks(2, [](int) {
    DistOptions options = testing::TestDistOptions();
    options.rendezvous_timeout = std::chrono::seconds(2);
    absl::StatusOr<std::shared_ptr<DistContext>> ctx = DistContext::InitFromEnvironment(options);
    ASSERT_FALSE(ctx.ok());
    // One of them sees the double claim; the other one cannot host the store (port taken) or
    // waits for rank 1 in vain.
    std::string m = Message(ctx.status());
    EXPECT_TRUE(m.find("two processes claim RANK=0") != std::string::npos ||
                m.find("already in use") != std::string::npos ||
                m.find("still waiting for rank(s) 1") != std::string::npos)
        << m;
  }, options);
}

TEST(RendezvousMultiRank, DisagreementOnWorldSizeIsNamed) {
  MultiRankOptions options;
  options.rank_env = [](int rank) -> std::map<std::string, std::string> {
    if (rank == 1) return {{"WORLD_SIZE", "3"}, {"LOCAL_WORLD_SIZE", "3"}};
    return {};
  };
  RunOnRanks(2, [](int rank) {
    DistOptions options = testing::TestDistOptions();
    options.rendezvous_timeout = std::chrono::seconds(2);
    absl::StatusOr<std::shared_ptr<DistContext>> ctx = DistContext::InitFromEnvironment(options);
    ASSERT_FALSE(ctx.ok());
    EXPECT_EQ(ctx.status().code(), absl::StatusCode::kInvalidArgument) << ctx.status();
    EXPECT_THAT(Message(ctx.status()), HasSubstr("ranks disagree on WORLD_SIZE"));
  }, options);
}

std::string StyleName(const ::testing::TestParamInfo<testing::EnvStyle>& info) {
  static const char* kNames[] = {"TorchrunAgentStore", "Plain", "Slurm", "OpenMpi", "Mpich"};
  return kNames[static_cast<int>(info.param)];
}

class RendezvousStyleTest : public ::testing::TestWithParam<testing::EnvStyle> {};

TEST_P(RendezvousStyleTest, EveryLauncherEnvironmentMeets) {
  MultiRankOptions options;
  options.style = GetParam();
  RunOnRanks(3, [](int rank) {
    std::shared_ptr<DistContext> ctx = InitDist();
    EXPECT_EQ(ctx->rank(), rank);
    EXPECT_EQ(ctx->world_size(), 3);
    EXPECT_EQ(ctx->env().local_rank, rank);
    at::Tensor t = at::full({2}, rank + 1.0);
    ctx->world().AllReduce(t)->wait();
    EXPECT_EQ(t[1].item<float>(), 6.0f);
  }, options);
}

INSTANTIATE_TEST_SUITE_P(Launchers, RendezvousStyleTest,
                         ::testing::Values(testing::EnvStyle::kTorchrunAgent,
                                           testing::EnvStyle::kPlain, testing::EnvStyle::kSlurm,
                                           testing::EnvStyle::kOpenMpi,
                                           testing::EnvStyle::kMpich),
                         StyleName);

TEST(RendezvousSingleProcess, StoreThatNeverAnswersFailsWithinTimeout) {
  LaunchEnv env;
  env.rank = 1;
  env.world_size = 2;
  env.master_addr = "127.0.0.1";
  env.master_port = testing::FreePort();  // nobody listens there
  env.source = "env";
  DistOptions options = testing::TestDistOptions();
  options.rendezvous_timeout = std::chrono::seconds(2);
  auto start = std::chrono::steady_clock::now();
  absl::StatusOr<std::shared_ptr<DistContext>> ctx = DistContext::Init(env, options);
  double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_FALSE(ctx.ok());
  // Nobody listens there (c10d's own connect error, or at our deadline "nothing listens at"),
  // unless another test of a parallel ctest run took the port meanwhile (a store that accepts
  // and never answers this job): each must fail in time, naming the address.
  EXPECT_THAT(Message(ctx.status()),
              ::testing::AnyOf(HasSubstr("could not connect to the rendezvous store at 127.0.0.1:"),
                               HasSubstr("nothing listens at 127.0.0.1:"),
                               HasSubstr("the store at 127.0.0.1:")));
  // The failure line adds "rank 1: ": the message itself must not name the rank again.
  EXPECT_THAT(Message(ctx.status()), Not(HasSubstr("rank 1")));
  EXPECT_THAT(Message(ctx.status()), HasSubstr("MASTER_ADDR/MASTER_PORT"));
  EXPECT_LT(waited, 15.0);
}

TEST(RendezvousSingleProcess, BusyPortIsNamed) {
  // Hold a listening socket on a port, then ask rank 0 to host the store there.
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = 0;
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(fd, 4), 0);
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  LaunchEnv env;
  env.rank = 0;
  env.world_size = 2;
  env.master_addr = "127.0.0.1";
  env.master_port = ntohs(addr.sin_port);
  env.source = "env";
  DistOptions options = testing::TestDistOptions();
  options.rendezvous_timeout = std::chrono::seconds(2);
  absl::StatusOr<std::shared_ptr<DistContext>> ctx = DistContext::Init(env, options);
  close(fd);
  ASSERT_FALSE(ctx.ok());
  EXPECT_THAT(Message(ctx.status()), HasSubstr("could not host the rendezvous store on port"));
  EXPECT_THAT(Message(ctx.status()), Not(HasSubstr("rank 0")));
  EXPECT_THAT(Message(ctx.status()), HasSubstr("already in use"));
}

TEST(RendezvousSingleProcess, NoLauncherMeansOneRank) {
  absl::StatusOr<LaunchEnv> env = ParseLaunchEnv(MapEnv({}));
  ASSERT_TRUE(env.ok());
  absl::StatusOr<std::shared_ptr<DistContext>> ctx = DistContext::Init(*env, testing::TestDistOptions());
  ASSERT_TRUE(ctx.ok()) << ctx.status();
  EXPECT_EQ((*ctx)->world_size(), 1);
  at::Tensor t = at::ones({3});
  (*ctx)->world().AllReduce(t)->wait();
  EXPECT_EQ(t[0].item<float>(), 1.0f);
}

}  // namespace
}  // namespace fsdp
