//! examples/mpi/ep_mpi.c under `mpirun -np 2` and `-np 4`, Open MPI forced onto TCP (`--mca pml
//! ob1 --mca btl tcp,self` on the loopback interface): a host-transport group over
//! MPI_Send/MPI_Recv/MPI_Allgather/MPI_Alltoallv (and, as a host built before the all_to_allv
//! callback, without MPI_Alltoallv) runs dispatch/combine through one backend per layout and an
//! EPLB rearrangement, and every rank checks its results against the single-process float32
//! reference (relative error at most 1e-5; every EPLB slot exactly right).
//!
//! Needs Open MPI's `mpicc` and `mpirun` (Debian: openmpi-bin, libopenmpi-dev); without them the
//! tests say SKIPPED, or fail when `EPCOMM_REQUIRE_MPI=1` (as in CI).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use common::skip::{required, skipped};
use common::*;

/// Bound on one mpirun (the ranks' own epcomm timeout is the default 60 s).
const MPI_TIMEOUT: Duration = Duration::from_secs(120);
/// The example's backends, one per layout, with the layout each must report.
const BACKENDS: [(&str, &str); 5] = [
    ("allgather_reducescatter", "REPLICATED"),
    ("deepep_high_throughput", "TOKEN_MAJOR"),
    ("deepep_low_latency", "EXPERT_MAJOR"),
    ("deepep_v2", "EXPERT_PACKED"),
    ("flashinfer_nvlink_two_sided", "RANK_MAJOR"),
];

fn have(tool: &str) -> bool {
    Command::new(tool)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// The example built with mpicc (once per test binary), or `None` after a visible skip.
fn example(test: &str) -> Option<&'static Path> {
    if !(have("mpicc") && have("mpirun")) {
        let why = "Open MPI (mpicc, mpirun) not found; install openmpi-bin and libopenmpi-dev";
        assert!(!required("EPCOMM_REQUIRE_MPI"), "{why}");
        skipped(test, why);
        return None;
    }
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    Some(EXE.get_or_init(|| {
        let exe = out_dir("mpi").join("ep_mpi");
        let mut args: Vec<String> = vec!["-std=c11".into()];
        args.extend(WARNING_FLAGS.iter().map(|s| s.to_string()));
        args.extend([
            format!("-I{}", include_dir().display()),
            manifest_dir()
                .join("examples/mpi/ep_mpi.c")
                .display()
                .to_string(),
            "-o".into(),
            exe.display().to_string(),
        ]);
        args.extend(link_cdylib_args());
        args.push("-lm".into());
        compile("mpicc", &args);
        exe
    }))
}

/// `mpirun -np N` over TCP only, root allowed (CI containers run as root), with `args`.
fn mpirun(exe: &Path, np: usize, args: &[&str], all_to_allv: bool) -> RunOutput {
    let mut cmd = Command::new("mpirun");
    // More ranks than this machine's cores: waiting ranks yield instead of spinning on the
    // cores the working ones need.
    cmd.args([
        "--oversubscribe",
        "--mca",
        "mpi_yield_when_idle",
        "1",
        "--mca",
        "pml",
        "ob1",
        "--mca",
        "btl",
        "tcp,self",
    ])
    .args(["--mca", "btl_tcp_if_include", "lo", "-np", &np.to_string()])
    .arg(exe)
    .args(args)
    .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
    .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    .env_remove("EPCOMM_LOG_LEVEL")
    .env("EPCOMM_MPI_ALLTOALLV", if all_to_allv { "1" } else { "0" })
    .current_dir(manifest_dir());
    run_with_timeout(cmd, MPI_TIMEOUT)
}

/// The relative error a rank printed for one backend.
fn error_of(line: &str) -> f64 {
    let e = line
        .rsplit("max relative error ")
        .next()
        .expect("an error figure");
    e.trim().parse().unwrap_or(f64::INFINITY)
}

fn check_job(np: usize, all_to_allv: bool) {
    let test = format!("mpi_ep_job_np{np}");
    let Some(exe) = example(&test) else { return };
    let out = mpirun(exe, np, &[], all_to_allv);
    assert!(
        out.success(),
        "{}",
        out.describe(&format!("mpirun -np {np}"))
    );
    let lines: Vec<&str> = out.stdout.lines().collect();
    for rank in 0..np {
        let tokens = 3 + rank % 4;
        for (backend, layout) in BACKENDS {
            let prefix = format!("rank {rank}: {backend:<28} {layout:<13} {tokens} tokens, ");
            let line = lines
                .iter()
                .find(|l| l.starts_with(&prefix))
                .unwrap_or_else(|| panic!("no line `{prefix}...` in:\n{}", out.stdout));
            let err = error_of(line);
            assert!(err <= 1e-5, "rank {rank} {backend}: error {err}");
        }
        // Layer 0 moves both of the rank's experts to the next rank; layer 1 swaps them locally.
        let eplb = format!("rank {rank}: eplb rearrange: 2 layers changed, 2 rows sent, 2 received, 2 copied locally, 0 wrong values");
        assert!(
            lines.contains(&eplb.as_str()),
            "no `{eplb}` in:\n{}",
            out.stdout
        );
    }
    let last = format!("ep_mpi: {np} ranks, 0 failure(s)");
    assert!(lines.contains(&last.as_str()), "{}", out.stdout);
}

#[test]
fn mpi_ep_job_np2() {
    check_job(2, true);
}

#[test]
fn mpi_ep_job_np4() {
    check_job(4, true);
}

#[test]
fn mpi_ep_job_np2_send_recv_only() {
    check_job(2, false);
}

#[test]
fn mpi_ep_job_np4_send_recv_only() {
    check_job(4, false);
}

/// A bad backend name is vLLM's error on every rank, and the job fails (no rank hangs).
#[test]
fn mpi_unknown_backend_fails_on_every_rank() {
    let Some(exe) = example("mpi_unknown_backend_fails_on_every_rank") else {
        return;
    };
    let out = mpirun(exe, 2, &["nonexistent"], true);
    assert!(!out.success(), "{}", out.describe("mpirun"));
    for rank in 0..2 {
        let want =
            format!("rank {rank}: nonexistent: ValueError: Unknown all2all backend: nonexistent");
        assert!(out.stderr.contains(&want), "{}", out.describe("mpirun"));
    }
    assert!(
        out.stdout.contains("ep_mpi: 2 ranks, 2 failure(s)"),
        "{}",
        out.stdout
    );
}
