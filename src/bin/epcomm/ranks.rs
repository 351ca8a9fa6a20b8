//! Rank processes for `demo` and `bench`: the command re-runs this binary, with the same
//! arguments, once per rank with the rank and the shared-memory group name in the environment.
//! Ranks report to the parent in lines on their stdout; their stderr is the parent's.

use std::io::BufRead;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{channel, Receiver};

const RANK_ENV: &str = "EPCOMM_CLI_RANK";
const GROUP_ENV: &str = "EPCOMM_CLI_GROUP";

/// In a rank process: (rank, group name).
pub fn this_rank() -> Option<(usize, String)> {
    let rank = std::env::var(RANK_ENV).ok()?.parse().ok()?;
    Some((rank, std::env::var(GROUP_ENV).ok()?))
}

/// In a rank process, runs `rank_main(rank, group)` and returns its exit code (errors go to
/// stderr prefixed with the rank); `None` in the parent.
pub fn as_rank(
    rank_main: impl FnOnce(usize, &str) -> Result<(), String>,
) -> Option<std::process::ExitCode> {
    let (rank, group) = this_rank()?;
    Some(match rank_main(rank, &group) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rank {rank}: {e}");
            std::process::ExitCode::from(1)
        }
    })
}

/// The start of a command that runs on rank processes: its parameters (a usage error ends the
/// command), and in a rank process the rank's work (whose exit code ends it).
pub fn start<P>(
    params: Result<P, String>,
    rank_main: impl FnOnce(&P, usize, &str) -> Result<(), String>,
) -> Result<P, std::process::ExitCode> {
    let p = params.map_err(|e| crate::usage_error(&e))?;
    match as_rank(|rank, group| rank_main(&p, rank, group)) {
        Some(code) => Err(code),
        None => Ok(p),
    }
}

/// Running rank processes: their stdout lines as they come, then their exit statuses.
pub struct Ranks {
    children: Vec<Child>,
    lines: Receiver<(usize, String)>,
}

impl Ranks {
    /// Starts `ranks` rank processes of this command on a fresh group (named after `prefix`
    /// and this process), with `extra_env` set.
    pub fn spawn(ranks: usize, prefix: &str, extra_env: &[(&str, &str)]) -> Result<Ranks, String> {
        let exe =
            std::env::current_exe().map_err(|e| format!("cannot find own executable: {e}"))?;
        let group = format!("{prefix}{}", std::process::id());
        let (tx, rx) = channel();
        let mut children = Vec::with_capacity(ranks);
        for r in 0..ranks {
            let mut cmd = Command::new(&exe);
            cmd.args(std::env::args_os().skip(1))
                .env(RANK_ENV, r.to_string())
                .env(GROUP_ENV, &group)
                .stdout(Stdio::piped());
            for (k, v) in extra_env {
                cmd.env(k, v);
            }
            let mut child = match cmd.spawn() {
                Ok(c) => c,
                Err(e) => {
                    for mut c in children {
                        let _ = Child::kill(&mut c);
                        let _ = c.wait();
                    }
                    return Err(format!("cannot run a rank: {e}"));
                }
            };
            let out = child.stdout.take().expect("stdout is piped");
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in std::io::BufReader::new(out).lines() {
                    let Ok(line) = line else { break };
                    if tx.send((r, line)).is_err() {
                        break;
                    }
                }
            });
            children.push(child);
        }
        Ok(Ranks {
            children,
            lines: rx,
        })
    }

    /// The next line some rank printed, as soon as it is printed; `None` once every rank
    /// closed its stdout.
    pub fn next_line(&self) -> Option<(usize, String)> {
        self.lines.recv().ok()
    }

    /// Waits for every rank; their exit statuses in rank order.
    pub fn wait(self) -> Vec<std::io::Result<ExitStatus>> {
        self.children.into_iter().map(|mut c| c.wait()).collect()
    }
}

/// What one rank printed and how it ended.
pub struct RankOutput {
    /// Everything the rank printed on stdout.
    pub stdout: String,
    /// Whether it exited with status 0.
    pub success: bool,
}

/// Runs `ranks` rank processes to the end (see [`Ranks::spawn`]); their outputs in rank order.
pub fn run(
    ranks: usize,
    prefix: &str,
    extra_env: &[(&str, &str)],
) -> Result<Vec<RankOutput>, String> {
    let r = Ranks::spawn(ranks, prefix, extra_env)?;
    let mut text = vec![String::new(); ranks];
    while let Some((rank, line)) = r.next_line() {
        text[rank].push_str(&line);
        text[rank].push('\n');
    }
    Ok(r.wait()
        .into_iter()
        .zip(text)
        .map(|(status, stdout)| RankOutput {
            stdout,
            success: status.is_ok_and(|s| s.success()),
        })
        .collect())
}

/// The option error for experts that do not split evenly over the ranks, or a top-k larger than
/// the experts (the MoE shape `demo` and `bench moe` run).
pub fn check_expert_shape(experts: usize, ranks: usize, topk: usize) -> Result<(), String> {
    if !experts.is_multiple_of(ranks) {
        return Err(format!(
            "--experts {experts} must be a multiple of --ranks {ranks} (each rank owns E/R experts)"
        ));
    }
    if topk > experts {
        return Err(format!("--topk {topk} exceeds --experts {experts}"));
    }
    Ok(())
}

/// The manager configuration of `demo` and `bench moe`: one float kind for the hidden rows, the
/// expert outputs and the result; no extras; M = `max_tokens`.
pub fn moe_config(
    experts: usize,
    topk: usize,
    hidden: usize,
    kind: epcomm::num::FloatKind,
    max_tokens: usize,
) -> epcomm::moe::MoeConfig {
    epcomm::moe::MoeConfig {
        num_experts: experts,
        top_k: topk,
        hidden,
        hidden_dtype: kind.dtype(),
        expert_dtype: kind,
        out_dtype: kind,
        max_tokens_per_rank: max_tokens,
        extra_row_bytes: vec![],
        apply_router_weight_on_input: false,
    }
}

/// Resolves a `--backend` value as the demo and the benchmark take it: the error names the
/// option and carries the "did you mean" hint (or the valid names).
pub fn resolve_backend(name: &str) -> Result<epcomm::select::all2all::Resolved, String> {
    epcomm::select::all2all::resolve_quiet(name).map_err(|e| {
        use epcomm::select::Hint;
        match e.hint() {
            Some(h) => format!("--backend: {e} ({h})"),
            None => format!("--backend: {e}"),
        }
    })
}
