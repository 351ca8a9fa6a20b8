//! Rank processes for `demo` and `bench`: the command re-runs this binary once per rank with
//! the rank and the shared-memory group name in the environment.

use std::process::{Command, Output, Stdio};

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

/// Runs `ranks` rank processes of `epcomm {command} {args}` on a fresh group (named after
/// `prefix` and this process) and returns their outputs (stdout captured), in rank order.
pub fn run(
    command: &[&str],
    args: &[String],
    ranks: usize,
    prefix: &str,
    extra_env: &[(&str, &str)],
) -> Result<Vec<Output>, String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find own executable: {e}"))?;
    let group = format!("{prefix}{}", std::process::id());
    let children: Vec<_> = (0..ranks)
        .map(|r| {
            let mut cmd = Command::new(&exe);
            cmd.args(command)
                .args(args)
                .env(RANK_ENV, r.to_string())
                .env(GROUP_ENV, &group)
                .stdout(Stdio::piped());
            for (k, v) in extra_env {
                cmd.env(k, v);
            }
            cmd.spawn()
        })
        .collect();
    children
        .into_iter()
        .map(|c| {
            c.and_then(|c| c.wait_with_output())
                .map_err(|e| format!("cannot run a rank: {e}"))
        })
        .collect()
}
