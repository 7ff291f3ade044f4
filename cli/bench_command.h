// `fsdp bench compare CONFIG ...`, `fsdp bench sweep ...`, `fsdp bench kernels CONFIG` and `fsdp bench host`
// (bench/bench.h): options and dispatch, kept out of main.cc.
#pragma once

#include <CLI/CLI.hpp>

#include "bench/bench.h"

namespace fsdp {

struct BenchCommand {
  bench::CompareOptions compare;
  bench::SweepOptions sweep;
  bench::KernelsOptions kernels;
  bench::HostOptions host;
  CLI::App* compare_cmd = nullptr;
  CLI::App* sweep_cmd = nullptr;
  CLI::App* kernels_cmd = nullptr;
  CLI::App* host_cmd = nullptr;
};

// Adds `bench` and its subcommands to `app`; returns the `bench` subcommand.
CLI::App* AddBenchCommand(CLI::App& app, BenchCommand& command);
// Runs whichever subcommand was parsed; the process exit code.
int RunBenchCommand(const BenchCommand& command);

}  // namespace fsdp
