// build/bin/fsdp: the one user-facing executable. Subcommands:
//   launch   start local ranks with torchrun's environment (launcher/launch.h)
//   doctor   check versions, devices, mesh and collectives on a cluster (cli/doctor.h)
//   train    train a model from a YAML configuration (cli/train.h, engine/trainer.h)
//   checkpoint inspect | export: look into a checkpoint, write it as safetensors
//   bench    compare | sweep: fsdp.cpp against PyTorch FSDP2, and across world sizes (bench/)
//   plan     predict memory and step time per layout, recommend one (cli/plan_command.h)
#include <cctype>
#include <exception>
#include <iostream>
#include <string>
#include <tuple>
#include <vector>

#include <CLI/CLI.hpp>

#include "cli/bench_command.h"
#include "cli/doctor.h"
#include "cli/checkpoint_command.h"
#include "cli/options.h"
#include "cli/plan_command.h"
#include "cli/train.h"
#include "common/failure.h"
#include "common/strings.h"
#include "common/user_input.h"
#include "device_mesh/torch_status.h"
#include "launcher/launch.h"

namespace {

// The subcommands of `app`, for "valid: ...".
std::string SubcommandNames(const CLI::App& app) {
  std::vector<std::string> names;
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; })) {
    names.push_back(sub->get_name());
  }
  return fsdp::StrJoin(names, ", ");
}

// CLI11 answers "fsdp bogus" and "fsdp bench bogus" with "A subcommand is required": the word
// after a command that needs a subcommand must name one. The error line, or "" when the words
// are subcommands (or options, which CLI11 judges).
std::string UnknownSubcommand(const CLI::App& app, const std::vector<std::string>& args) {
  const CLI::App* command = &app;
  std::string path = app.get_name();
  for (const std::string& word : args) {
    if (command->get_require_subcommand_min() == 0 || fsdp::StartsWith(word, "-")) break;
    std::vector<const CLI::App*> match =
        command->get_subcommands([&word](const CLI::App* sub) { return sub->get_name() == word; });
    if (match.empty()) {
      return fsdp::StrCat(path, ": unknown subcommand '", word,
                          "' (valid: ", SubcommandNames(*command), ")");
    }
    command = match.front();
    path += " " + word;
  }
  return "";
}

// Every command-line error is one line "fsdp SUBCOMMAND: what" and exit code 2 (Note [Exit
// codes], common/failure.h); --help and --help-all print and exit 0, as CLI11 does.
int ExitForParseError(CLI::App& app, const CLI::ParseError& e) {
  if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) return app.exit(e);
  const CLI::App* command = &app;
  std::string path = app.get_name();
  while (!command->get_subcommands().empty()) {
    command = command->get_subcommands().front();
    path += " " + command->get_name();
  }
  std::string what = e.what();
  if (dynamic_cast<const CLI::RequiredError*>(&e) != nullptr &&
      command->get_require_subcommand_min() > 0 && what.find("subcommand") != std::string::npos) {
    what = fsdp::StrCat("a subcommand is required (valid: ", SubcommandNames(*command), ")");
  } else if (!what.empty()) {
    what[0] = static_cast<char>(std::tolower(static_cast<unsigned char>(what[0])));
  }
  std::cerr << path << ": " << what << "\n";
  return 2;
}

// `fsdp launch --help`: one usage line that shows the "--" before PROGRAM (CLI11's own would
// list PROGRAM as an option, "[program...]").
class LaunchFormatter : public CLI::Formatter {
 public:
  std::string make_usage(const CLI::App* /*app*/, std::string name) const override {
    return fsdp::StrCat("Usage: ", name, " [OPTIONS] -- PROGRAM [ARGS...]\n");
  }
};

// Note [No rank dies through an uncaught exception]
// An exception that escapes a thread (a backend's own thread, a destructor during unwinding)
// calls std::terminate, whose default prints "terminate called ..." and aborts (exit 134):
// the launcher would then blame a healthy rank for "signal 6". This handler, and the catch
// in main, turn it into the rank's one failure line (common/failure.h) and an exit code.
[[noreturn]] void OnTerminate() {
  absl::Status status = absl::InternalError("std::terminate called without an exception");
  if (std::exception_ptr e = std::current_exception()) {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& x) {
      status = fsdp::StatusFromException("uncaught exception", x);
    } catch (...) {
      status = absl::InternalError("uncaught exception of unknown type");
    }
  }
  const fsdp::FailureClass c = fsdp::ClassifyFailure(status);
  fsdp::FailAndExit(fsdp::FailureRank(), c,
                    fsdp::StrCat(fsdp::FailureClassName(c), ": ", std::string(status.message())));
}

int Main(int argc, char** argv);

}  // namespace

int main(int argc, char** argv) {
  std::set_terminate(OnTerminate);
  try {
    return Main(argc, argv);
  } catch (const std::exception& e) {
    const absl::Status status = fsdp::StatusFromException("uncaught exception", e);
    const fsdp::FailureClass c = fsdp::ClassifyFailure(status);
    fsdp::FailAndExit(fsdp::FailureRank(), c,
                      fsdp::StrCat(fsdp::FailureClassName(c), ": ", std::string(status.message())));
  }
}

namespace {

int Main(int argc, char** argv) {
  // PROGRAM ARGS after "--" belong to the launched program, not to us.
  std::vector<std::string> program;
  int our_argc = argc;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--") {
      program.assign(argv + i + 1, argv + argc);
      our_argc = i;
      break;
    }
  }

  CLI::App app{"fsdp.cpp: sharded data-parallel training on libtorch", "fsdp"};
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all", "Help for every subcommand");

  // ---- launch ------------------------------------------------------------------------------
  fsdp::LaunchOptions launch;
  int grace_s = 5;
  int rdzv_timeout_s = 300;
  bool no_prefix = false;
  CLI::App* launch_cmd = app.add_subcommand(
      "launch",
      "Start local ranks of PROGRAM with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, "
      "MASTER_ADDR, MASTER_PORT, TORCHELASTIC_*), prefix their output with the rank, stop all "
      "when one fails.");
  launch_cmd->formatter(std::make_shared<LaunchFormatter>());
  launch_cmd->add_option("--nproc-per-node", launch.nproc_per_node,
                         "Ranks to start on this node")->required()->check(fsdp::IntAtLeast(1));
  launch_cmd->add_option("--nnodes", launch.nnodes, "Number of nodes")
      ->capture_default_str()->check(fsdp::IntAtLeast(1));
  launch_cmd->add_option("--node-rank", launch.node_rank, "This node's index, 0..nnodes-1")
      ->capture_default_str()->check(fsdp::IntAtLeast(0));
  launch_cmd->add_option("--master-addr", launch.master_addr,
                         "Host of node 0 (whose launcher hosts the rendezvous store)")
      ->capture_default_str();
  launch_cmd->add_option("--master-port", launch.master_port,
                         "Port of the rendezvous store; 0 picks a free one (single node only)")
      ->capture_default_str()->check(fsdp::IntInRange(0, 65535));
  launch_cmd->add_option("--max-restarts", launch.max_restarts,
                         "Restart the local group this many times when a rank fails "
                         "(TORCHELASTIC_RESTART_COUNT counts them)")
      ->capture_default_str()->check(fsdp::IntAtLeast(0));
  launch_cmd->add_option("--rdzv-timeout", rdzv_timeout_s,
                         "Seconds a non-zero node waits for node 0's store")
      ->capture_default_str()->check(fsdp::IntAtLeast(1));
  launch_cmd->add_option("--grace", grace_s,
                         "Seconds between SIGTERM and SIGKILL when stopping ranks")
      ->capture_default_str()->check(fsdp::IntAtLeast(0));
  launch_cmd->add_option("--run-id", launch.run_id,
                         "TORCHELASTIC_RUN_ID (random if unset); also --log-dir's RUN_ID folder");
  launch_cmd->add_flag("--no-prefix", no_prefix, "Do not prefix output lines with [rankN]:");
  launch_cmd
      ->add_option("--log-dir", launch.log_dir,
                   "Also write each rank's stdout and stderr to "
                   "DIR/RUN_ID/attempt_RESTART/LOCAL_RANK/{stdout,stderr}.log (a new "
                   "attempt_ folder per restart; DIR/RUN_ID/node_N/attempt_... with "
                   "--nnodes > 1), line by line as they arrive; the console still shows "
                   "every line unless --redirects says otherwise")
      ->type_name("DIR");
  launch_cmd
      ->add_option("--redirects,-r", launch.redirects,
                   "With --log-dir: streams in the files only, off the console, as "
                   "torchrun's: 0 none, 1 stdout, 2 stderr, 3 both, or per local rank "
                   "LOCAL_RANK:VALUE,... (e.g. 0:3,1:2)")
      ->type_name("VALUE");
  launch_cmd
      ->add_option("--tee,-t", launch.tee,
                   "With --log-dir: streams on the console too, even if in --redirects "
                   "(same values; --redirects 3 --tee 0:3 shows local rank 0 only)")
      ->type_name("VALUE");
  std::vector<std::string> positional_program;
  launch_cmd->add_option("program", positional_program, "PROGRAM [ARGS...] (after --)");

  // ---- doctor ------------------------------------------------------------------------------
  fsdp::DoctorOptions doctor;
  std::string min_bytes = "1K", max_bytes = "4M";
  CLI::App* doctor_cmd = app.add_subcommand(
      "doctor",
      "Check a cluster: versions, devices, this rank's mesh coordinates and axis groups, then "
      "all-reduce / all-gather / reduce-scatter on every mesh axis against closed-form values, "
      "with bus bandwidth. Run it under a launcher, e.g.\n"
      "  fsdp launch --nproc-per-node 4 -- fsdp doctor --mesh 2,2\n"
      "Exit code: 0 all correct, 1 a wrong element, 2 bad options or environment (e.g. --device "
      "cuda without a GPU), 3 rendezvous or communication failure.");
  doctor_cmd->add_option("--mesh", doctor.mesh,
                         "Mesh degrees, e.g. 4, 2,2, 2x2 or replicate=2,shard=-1 (-1: infer); "
                         "default: 1-D over all ranks");
  doctor_cmd->add_option("--device", doctor.device, "cpu, cuda or auto (cuda if a GPU is visible)")
      ->capture_default_str()->check(CLI::IsMember({"cpu", "cuda", "auto"}));
  doctor_cmd->add_option("--backend", doctor.backend, "Backend for CUDA tensors: nccl or gloo")
      ->capture_default_str()->check(CLI::IsMember({"nccl", "gloo"}));
  doctor_cmd->add_option("--cpu-collectives", doctor.cpu_collectives,
                         "CPU all-gather / reduce-scatter: p2p (ours, over Gloo's send/recv) or "
                         "gloo (c10d's Gloo collectives)")
      ->capture_default_str()->check(CLI::IsMember({"p2p", "gloo"}));
  doctor_cmd->add_option("--min-bytes", min_bytes, "Smallest buffer (4096, 64K, 16M...)")
      ->capture_default_str();
  doctor_cmd->add_option("--max-bytes", max_bytes, "Largest buffer; sizes grow 4x")
      ->capture_default_str();
  doctor_cmd->add_option("--iters", doctor.iters, "Timed runs per size (median reported)")
      ->capture_default_str()->check(fsdp::IntAtLeast(1));
  doctor_cmd->add_option("--warmup", doctor.warmup, "Untimed runs per size")
      ->capture_default_str()->check(fsdp::IntAtLeast(0));
  doctor_cmd->add_option("--timeout", doctor.timeout_s,
                         "Seconds to wait for other ranks (rendezvous and each collective)")
      ->capture_default_str()->check(fsdp::IntAtLeast(1));

  // ---- train -------------------------------------------------------------------------------
  fsdp::TrainCommand train;
  CLI::App* train_cmd = app.add_subcommand(
      "train",
      "Train a model from a YAML configuration. Under a launcher (fsdp launch, torchrun, srun, "
      "mpirun) it runs as that rank; run directly, it starts parallelism.nproc local ranks "
      "itself (GPUs, or 2 CPU ranks), like torchrun --standalone.\n"
      "Example: fsdp train configs/default.yaml --set training.steps=50");
  train_cmd->add_option("config", train.config_path, "YAML configuration file")->required();
  train_cmd->add_option("--set", train.overrides,
                        "Override a key: --set section.key=value (repeatable)");
  train_cmd->add_flag("--oversubscribe", train.oversubscribe,
                      "Allow parallelism.nproc above the node's GPUs (CUDA) or 4 x its cores "
                      "(CPU ranks)");
  train_cmd->add_flag("--quiet,-q", train.quiet,
                      "No start-up output (configuration dump, run summary); errors and step "
                      "lines are still printed");

  // ---- checkpoint --------------------------------------------------------------------------
  fsdp::CheckpointCommand ckpt;
  CLI::App* ckpt_cmd = app.add_subcommand("checkpoint", "Inspect or export a checkpoint");
  ckpt_cmd->require_subcommand(1);
  CLI::App* inspect_cmd = ckpt_cmd->add_subcommand(
      "inspect", "Print a checkpoint's step, mesh, tensors and sizes, and whether it is complete");
  inspect_cmd->add_option("dir", ckpt.dir, "Checkpoint folder (step_N), or a run's checkpoints "
                                           "folder (its newest checkpoint)")->required();
  inspect_cmd->add_flag("--verify", ckpt.verify, "Also recompute every file's CRC-32");
  CLI::App* export_cmd = ckpt_cmd->add_subcommand(
      "export", "Write the model's tensors as one safetensors file, or a Hugging Face Llama "
      "folder (--format hf), streaming tensor by tensor");
  export_cmd->add_option("dir", ckpt.dir, "Checkpoint folder, or a checkpoints folder")->required();
  export_cmd->add_option("--out", ckpt.out,
                         "Output .safetensors file (--format safetensors) or folder (hf)")
      ->required();
  export_cmd->add_option("--dtype", ckpt.dtype, "Convert floating tensors: bf16, fp16, fp32")
      ->check(CLI::IsMember({"bf16", "fp16", "fp32"}));
  export_cmd
      ->add_option("--format", ckpt.format,
                   "safetensors: one file with our names | hf: a Hugging Face Llama folder "
                   "(config.json + safetensors) that LlamaForCausalLM.from_pretrained loads")
      ->check(CLI::IsMember({"safetensors", "hf"}))
      ->capture_default_str();
  export_cmd->add_option("--max-shard-size", ckpt.max_shard_size,
                         "--format hf: largest file before splitting into "
                         "model-0000N-of-0000M.safetensors with an index (5GB, 500MB, bytes)")
      ->capture_default_str();

  // ---- plan --------------------------------------------------------------------------------
  fsdp::PlanCommand plan;
  CLI::App* plan_cmd = app.add_subcommand(
      "plan",
      "Predict per-rank memory and step time of every layout (full_shard, shard_grad_op, "
      "hybrid_shard RxS, no_shard) and recommend the fastest that fits. E.g.\n"
      "  fsdp plan configs/llama_1b.yaml --world-size 64 --gpus-per-node 8 --gpu h100\n"
      "  fsdp plan --calibrate --out cpu.json   (measure this machine's CPU profile)\n"
      "  fsdp plan --calibrate-host --gpu h100 --out here.json   (on a GPU node: offload's host)");
  plan_cmd->add_option("config", plan.config_path, "YAML configuration file");
  plan_cmd->add_option("--set", plan.overrides,
                       "Override a key: --set section.key=value (repeatable)");
  plan_cmd->add_option("--world-size", plan.world_size, "Total ranks (GPUs)")
      ->check(fsdp::IntAtLeast(1));
  plan_cmd->add_option("--gpus-per-node", plan.gpus_per_node,
                       "Ranks per node (default: the world size up to 8, else 8)")
      ->check(fsdp::IntAtLeast(1));
  plan_cmd->add_option("--gpu", plan.gpu, "Hardware profile: h100, h200, a100-80gb, a100-40gb, cpu")
      ->capture_default_str();
  plan_cmd->add_option("--hardware", plan.hardware_file,
                       "A JSON hardware profile (fields of plan::Hardware; see docs/cost_model.md)");
  plan_cmd->add_option("--top", plan.top, "Show only the K best layouts (0: all)")
      ->check(fsdp::IntAtLeast(0));
  plan_cmd->add_option("--json", plan.json_out, "Also write every prediction to this JSON file");
  plan_cmd->add_flag("--calibrate", plan.calibrate,
                     "Measure this machine (GEMM, copy, Gloo all-gather) and print a profile");
  plan_cmd->add_flag("--calibrate-host", plan.calibrate_host,
                     "Measure this machine's host (offload's AdamW and loops, memory) and print "
                     "the --gpu (or --hardware) profile with those figures; run it on the GPU "
                     "node");
  plan_cmd->add_option("--out", plan.calibrate_out,
                       "With --calibrate or --calibrate-host: write the profile here");

  // ---- bench -------------------------------------------------------------------------------
  fsdp::BenchCommand bench;
  CLI::App* bench_cmd = fsdp::AddBenchCommand(app, bench);

  if (std::string unknown =
          UnknownSubcommand(app, std::vector<std::string>(argv + 1, argv + our_argc));
      !unknown.empty()) {
    std::cerr << unknown << "\n";
    return 2;
  }
  try {
    app.parse(our_argc, argv);
  } catch (const CLI::ParseError& e) {
    return ExitForParseError(app, e);
  }

  if (launch_cmd->parsed()) {
    if (!program.empty() && !positional_program.empty()) {
      std::cerr << "fsdp launch: give PROGRAM after --, not before it\n";
      return 2;
    }
    launch.program = program.empty() ? positional_program : program;
    launch.grace = std::chrono::seconds(grace_s);
    launch.rendezvous_timeout = std::chrono::seconds(rdzv_timeout_s);
    launch.prefix_output = !no_prefix;
    return fsdp::RunLaunch(launch);
  }
  if (train_cmd->parsed()) return fsdp::RunTrainCommand(train, argc, argv);
  if (bench_cmd->parsed()) return fsdp::RunBenchCommand(bench);
  if (inspect_cmd->parsed()) return fsdp::RunCheckpointInspect(ckpt);
  if (export_cmd->parsed()) return fsdp::RunCheckpointExport(ckpt);
  if (plan_cmd->parsed()) {
    if (!program.empty()) {
      std::cerr << "fsdp plan: unexpected arguments after --\n";
      return 2;
    }
    if (!plan.calibrate && !plan.calibrate_host && plan.world_size < 1) {
      std::cerr << "fsdp plan: --world-size N is required (N >= 1), e.g. --world-size 8\n";
      return 2;
    }
    return fsdp::RunPlanCommand(plan);
  }
  if (doctor_cmd->parsed()) {
    if (!program.empty()) {
      std::cerr << "fsdp doctor: unexpected arguments after --\n";
      return 2;
    }
    for (auto [flag, text, bytes] : {std::tuple("--min-bytes", &min_bytes, &doctor.min_bytes),
                                     std::tuple("--max-bytes", &max_bytes, &doctor.max_bytes)}) {
      absl::StatusOr<int64_t> parsed = fsdp::ParseBinarySize(*text);
      if (!parsed.ok()) {
        std::cerr << "fsdp doctor: " << flag << ": " << parsed.status().message() << "\n";
        return 2;
      }
      *bytes = *parsed;
    }
    return fsdp::RunDoctor(doctor);
  }
  return 2;
}

}  // namespace
