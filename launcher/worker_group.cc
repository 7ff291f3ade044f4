#include "launcher/worker_group.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstring>
#include <chrono>
#include <thread>

#include "common/strings.h"

extern char** environ;

namespace fsdp {

struct WorkerGroup::Worker {
  WorkerSpec spec;
  pid_t pid = -1;
  int fds[2] = {-1, -1};  // stdout, stderr read ends
  std::string partial[2];
  bool running = false;
  WorkerExit exit;
};

namespace {

volatile std::sig_atomic_t g_stop_signal = 0;
void OnStopSignal(int signal) { g_stop_signal = signal; }

std::string SignalName(int signal) {
  const char* name = strsignal(signal);
  return name ? name : "unknown";
}

void AddTail(std::deque<std::string>& tail, std::string_view line, size_t max_lines) {
  tail.emplace_back(line);
  while (tail.size() > max_lines) tail.pop_front();
}

}  // namespace

void InstallStopSignalHandlers() {
  struct sigaction action {};
  action.sa_handler = OnStopSignal;
  sigemptyset(&action.sa_mask);
  for (int s : {SIGINT, SIGTERM, SIGHUP}) sigaction(s, &action, nullptr);
}

int ReceivedStopSignal() { return g_stop_signal; }

std::string WorkerExit::Describe() const {
  if (exited) return StrCat("exited with code ", code);
  return StrCat("was killed by signal ", code, " (", SignalName(code), ")");
}

std::string GroupResult::Summary() const {
  switch (outcome) {
    case Outcome::kSucceeded:
      return StrCat("all ", exits.size(), " workers exited with code 0");
    case Outcome::kWorkerFailed:
      return StrCat("rank ", first_failure->rank, " ", first_failure->Describe());
    case Outcome::kTimedOut:
      return "workers did not finish before the deadline and were stopped";
    case Outcome::kStopped:
      return "workers were stopped on request";
  }
  return "";
}

WorkerGroup::WorkerGroup(std::function<void(const OutputLine&)> sink) : sink_(std::move(sink)) {}

WorkerGroup::~WorkerGroup() {
  for (Worker& w : workers_) {
    if (w.running) {
      kill(-w.pid, SIGKILL);
      waitpid(w.pid, nullptr, 0);
    }
    for (int fd : w.fds) {
      if (fd >= 0) close(fd);
    }
  }
}

absl::Status WorkerGroup::Start(const std::vector<WorkerSpec>& specs) {
  for (const WorkerSpec& spec : specs) {
    if (spec.argv.empty()) return absl::InvalidArgumentError("a worker needs a program to run");
    // Everything the child needs is built before fork: between fork and exec only
    // async-signal-safe calls are allowed (the supervisor may have threads).
    std::map<std::string, std::string> env_map;
    for (char** e = environ; *e != nullptr; ++e) {
      std::string_view kv(*e);
      size_t eq = kv.find('=');
      if (eq != std::string_view::npos) env_map[std::string(kv.substr(0, eq))] = kv.substr(eq + 1);
    }
    for (const auto& [k, v] : spec.env) {
      if (v.empty()) {
        env_map.erase(k);
      } else {
        env_map[k] = v;
      }
    }
    std::vector<std::string> env_strings;
    for (const auto& [k, v] : env_map) env_strings.push_back(k + "=" + v);
    std::vector<char*> envp;
    for (std::string& s : env_strings) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::vector<std::string> argv_strings = spec.argv;
    std::vector<char*> argv;
    for (std::string& s : argv_strings) argv.push_back(s.data());
    argv.push_back(nullptr);
    std::string exec_error = StrCat("fsdp launch: cannot execute '", spec.argv[0], "': ");

    int out_pipe[2], err_pipe[2];
    if (pipe2(out_pipe, O_CLOEXEC) != 0 || pipe2(err_pipe, O_CLOEXEC) != 0) {
      return absl::InternalError(StrCat("pipe2 failed: ", strerror(errno)));
    }
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0) {
      return absl::InternalError(StrCat("fork failed for rank ", spec.rank, ": ", strerror(errno)));
    }
    if (pid == 0) {
      setpgid(0, 0);
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(128 + SIGKILL);  // the supervisor died before prctl
      dup2(out_pipe[1], STDOUT_FILENO);
      dup2(err_pipe[1], STDERR_FILENO);
      signal(SIGINT, SIG_DFL);
      signal(SIGTERM, SIG_DFL);
      signal(SIGHUP, SIG_DFL);
      execvpe(argv[0], argv.data(), envp.data());
      int err = errno;
      const char* reason = strerror(err);
      (void)!write(STDERR_FILENO, exec_error.data(), exec_error.size());
      (void)!write(STDERR_FILENO, reason, strlen(reason));
      (void)!write(STDERR_FILENO, "\n", 1);
      _exit(err == ENOENT ? 127 : 126);
    }
    setpgid(pid, pid);  // also from the parent, so a kill(-pid) right away cannot miss
    close(out_pipe[1]);
    close(err_pipe[1]);
    Worker w;
    w.spec = spec;
    w.pid = pid;
    w.fds[0] = out_pipe[0];
    w.fds[1] = err_pipe[0];
    w.running = true;
    w.exit.rank = spec.rank;
    workers_.push_back(std::move(w));
  }
  return absl::OkStatus();
}

void WorkerGroup::Pump(int timeout_ms, size_t tail_lines) {
  std::vector<pollfd> pfds;
  std::vector<std::pair<size_t, int>> owners;
  for (size_t i = 0; i < workers_.size(); ++i) {
    for (int k = 0; k < 2; ++k) {
      if (workers_[i].fds[k] >= 0) {
        pfds.push_back({workers_[i].fds[k], POLLIN, 0});
        owners.emplace_back(i, k);
      }
    }
  }
  if (pfds.empty()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(timeout_ms));
    return;
  }
  int n = poll(pfds.data(), pfds.size(), timeout_ms);
  if (n <= 0) return;  // timeout or EINTR (a signal: the caller checks it)
  char buf[65536];
  for (size_t j = 0; j < pfds.size(); ++j) {
    if (pfds[j].revents == 0) continue;
    auto [i, k] = owners[j];
    Worker& w = workers_[i];
    ssize_t got = read(w.fds[k], buf, sizeof(buf));
    if (got > 0) {
      w.partial[k].append(buf, static_cast<size_t>(got));
      size_t start = 0;
      for (size_t nl; (nl = w.partial[k].find('\n', start)) != std::string::npos; start = nl + 1) {
        std::string_view line(w.partial[k].data() + start, nl - start);
        sink_(OutputLine{w.spec.rank, k == 1, line});
        AddTail(w.exit.tail, line, tail_lines);
      }
      w.partial[k].erase(0, start);
    } else if (got == 0 || (errno != EINTR && errno != EAGAIN)) {
      if (!w.partial[k].empty()) {  // a last line without newline
        sink_(OutputLine{w.spec.rank, k == 1, w.partial[k]});
        AddTail(w.exit.tail, w.partial[k], tail_lines);
        w.partial[k].clear();
      }
      close(w.fds[k]);
      w.fds[k] = -1;
    }
  }
}

void WorkerGroup::Reap(size_t tail_lines) {
  for (Worker& w : workers_) {
    if (!w.running) continue;
    int status = 0;
    pid_t r = waitpid(w.pid, &status, WNOHANG);
    if (r != w.pid) continue;
    w.running = false;
    w.exit.exited = WIFEXITED(status);
    w.exit.code = WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status);
    w.exit.exit_time_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                              std::chrono::system_clock::now().time_since_epoch())
                              .count();
    // Whatever the worker's own children still hold open is not waited for.
    kill(-w.pid, SIGKILL);
  }
}

bool WorkerGroup::AllExited() const {
  for (const Worker& w : workers_) {
    if (w.running) return false;
  }
  return true;
}

void WorkerGroup::SignalAll(int signal) {
  for (Worker& w : workers_) {
    if (w.running) kill(-w.pid, signal);
  }
}

void WorkerGroup::StopAll(std::chrono::milliseconds grace, size_t tail_lines) {
  for (Worker& w : workers_) {
    if (w.running) w.exit.killed_by_us = true;
  }
  SignalAll(SIGTERM);
  auto kill_at = std::chrono::steady_clock::now() + grace;
  while (!AllExited() && std::chrono::steady_clock::now() < kill_at) {
    Pump(20, tail_lines);
    Reap(tail_lines);
  }
  SignalAll(SIGKILL);
  while (!AllExited()) {
    Pump(20, tail_lines);
    Reap(tail_lines);
  }
}

GroupResult WorkerGroup::Wait(const WaitOptions& options) {
  GroupResult result;
  auto next_stop_check = std::chrono::steady_clock::now();
  while (true) {
    Pump(50, options.tail_lines);
    Reap(options.tail_lines);
    for (Worker& w : workers_) {
      if (!w.running && !w.exit.ok() && !result.first_failure) {
        result.outcome = GroupResult::Outcome::kWorkerFailed;
        result.first_failure = w.exit;
      }
    }
    if (result.first_failure) break;
    if (AllExited()) break;
    auto now = std::chrono::steady_clock::now();
    if (options.deadline && now >= *options.deadline) {
      result.outcome = GroupResult::Outcome::kTimedOut;
      break;
    }
    if (options.stop_requested && now >= next_stop_check) {
      next_stop_check = now + std::chrono::milliseconds(200);
      if (options.stop_requested()) {
        result.outcome = GroupResult::Outcome::kStopped;
        break;
      }
    }
  }
  StopAll(result.first_failure ? options.failure_grace : options.grace, options.tail_lines);
  // Drain what is left in the pipes (bounded: a detached grandchild may keep one open).
  bool open = true;
  auto drain_until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (open && std::chrono::steady_clock::now() < drain_until) {
    open = false;
    for (const Worker& w : workers_) open = open || w.fds[0] >= 0 || w.fds[1] >= 0;
    if (open) Pump(20, options.tail_lines);
  }
  if (result.first_failure) {
    for (const Worker& w : workers_) {
      if (w.spec.rank == result.first_failure->rank) result.first_failure = w.exit;
    }
  }
  for (const Worker& w : workers_) result.exits.push_back(w.exit);
  return result;
}

}  // namespace fsdp
