//! The `EPCOMM_*` variables the library reads: an invalid value gives exactly one warning
//! naming the variable, the value, what is accepted and what is used instead; valid values
//! behave as documented in `epcomm::env`. Each case runs in a child process (this binary again,
//! for the test `child`, with a clean `EPCOMM_*` environment plus the case's variable), which
//! asserts what the variable does; the parent asserts the child's exact stderr lines.

mod log_lines;

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::os::unix::process::ExitStatusExt;
use std::time::Duration;

use epcomm::group::shm::ShmGroup;
use epcomm::group::GroupOptions;
use epcomm::log::{self, Level};
use log_lines::{messages, run_child};

/// Set in a child process to the case it runs.
const CHILD: &str = "EPCOMM_TEST_ENV_CHILD";
/// Set in a child process to what the case expects (e.g. a timeout in seconds).
const EXPECT: &str = "EPCOMM_TEST_ENV_EXPECT";

fn expect() -> String {
    std::env::var(EXPECT).unwrap_or_default()
}

/// Child side: does what reads the variable of the case (twice, where it is read per use, to
/// show the warning comes once) and asserts its effect.
#[test]
fn child() {
    let Some(case) = std::env::var_os(CHILD) else {
        return;
    };
    match case.to_str().unwrap() {
        "log_level" => {
            log::log(Level::Debug, "a debug message");
            log::info("an info");
            log::warn("a warning");
            log::log(Level::Error, "an error");
        }
        "log_level_sink" => {
            // A sink installed before anything is logged receives the warning, stderr nothing.
            let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
            let s = seen.clone();
            log::set_sink(Some(std::sync::Arc::new(move |l, m: &str| {
                s.lock().unwrap().push((l, m.to_owned()))
            })));
            log::warn("a warning");
            log::set_sink(None);
            assert_eq!(
                *seen.lock().unwrap(),
                [
                    (Level::Warn, expect()),
                    (Level::Warn, "a warning".to_owned())
                ]
            );
        }
        "timeout" => {
            let want = Duration::from_secs_f64(expect().parse().unwrap());
            assert_eq!(GroupOptions::default().timeout, want);
            assert_eq!(GroupOptions::default().timeout, want);
        }
        "shm_direct" => {
            let want = expect() == "1";
            let name = format!("envtest{}", std::process::id());
            for _ in 0..2 {
                let g = ShmGroup::join(&name, 0, 1, GroupOptions::default()).unwrap();
                assert_eq!(g.direct(), want);
            }
        }
        "no_simd" => {
            let want = expect() == "1";
            assert_eq!(epcomm::env::no_simd(), want);
            assert_eq!(epcomm::env::no_simd(), want);
            #[cfg(target_arch = "x86_64")]
            assert_eq!(
                epcomm::num::simd_available(),
                !want && is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c")
            );
        }
        "fault_point" => {
            // A valid point kills the process here; any other value leaves it running.
            epcomm::fault::point("join");
            epcomm::fault::point("combine");
        }
        "nvrtc_path" => {
            let want = Some(expect()).filter(|s| !s.is_empty());
            assert_eq!(epcomm::env::nvrtc_path(), want);
            assert_eq!(epcomm::env::nvrtc_path(), want);
        }
        "cache_dir" => {
            assert_eq!(
                epcomm::gpu::nvrtc::default_cache_dir(),
                Some(std::path::PathBuf::from(expect()))
            );
        }
        "nvrtc_lineinfo" => {
            let v = epcomm::gpu::kernels::variants().into_iter().next().unwrap();
            for _ in 0..2 {
                let (_, opts) = epcomm::gpu::kernels::source(&v);
                let has = opts.iter().any(|o| o == "-lineinfo");
                assert_eq!(has, expect() == "1", "{opts:?}");
            }
        }
        other => panic!("unknown case {other}"),
    }
}

/// Runs case `case` with `var=value` and asserts the child succeeded and logged exactly
/// `want` (each line after its `{host}:{pid}:{tid} ` prefix).
fn check(case: &str, var: &str, value: impl Into<OsString>, expect: &str, want: &[&str]) {
    let value = value.into();
    let (pid, o) = run_child(
        "child",
        &[
            (CHILD, case.into()),
            (EXPECT, expect.into()),
            (var, value.clone()),
        ],
    );
    assert!(
        o.status.success(),
        "{case} with {var}={value:?}: {:?}\n{}",
        o.status,
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(messages(&o, pid), want, "{case} with {var}={value:?}");
}

/// `epcomm WARNING invalid {var}='{value}' (expected {expected}); using {instead}`.
fn invalid(var: &str, value: &str, expected: &str, instead: &str) -> String {
    format!("epcomm WARNING invalid {var}='{value}' (expected {expected}); using {instead}")
}

#[test]
fn log_level() {
    let var = "EPCOMM_LOG_LEVEL";
    for bad in ["verbose", "3", "warn ing"] {
        check(
            "log_level",
            var,
            bad,
            "",
            &[
                &invalid(var, bad, "error|warn|info|debug", "warn"),
                "epcomm WARNING a warning",
                "epcomm ERROR an error",
            ],
        );
    }
    let everything = [
        "epcomm DEBUG a debug message",
        "epcomm INFO an info",
        "epcomm WARNING a warning",
        "epcomm ERROR an error",
    ];
    check("log_level", var, "", "", &everything[2..]);
    check("log_level", var, "error", "", &everything[3..]);
    check("log_level", var, "Warning", "", &everything[2..]);
    check("log_level", var, " INFO ", "", &everything[1..]);
    check("log_level", var, "debug", "", &everything);
    let w = invalid(var, "loud", "error|warn|info|debug", "warn");
    check(
        "log_level_sink",
        var,
        "loud",
        w.strip_prefix("epcomm WARNING ").unwrap(),
        &[],
    );
}

#[test]
fn timeout() {
    let var = "EPCOMM_TIMEOUT_S";
    let expected = "seconds > 0, at most 86400 (one day)";
    for bad in ["abc", "0", "-1", "inf", "NaN", "1e9", "1e300", "60s"] {
        check(
            "timeout",
            var,
            bad,
            "60",
            &[&invalid(var, bad, expected, "the default 60 s")],
        );
    }
    check("timeout", var, "2.5", "2.5", &[]);
    check("timeout", var, " 7 ", "7", &[]);
    check("timeout", var, "86400", "86400", &[]);
    check("timeout", var, "", "60", &[]);
}

#[test]
fn shm_direct() {
    let var = "EPCOMM_SHM_DIRECT";
    for bad in ["maybe", "true", "2"] {
        check(
            "shm_direct",
            var,
            bad,
            "1",
            &[&invalid(var, bad, "0 or 1", "1")],
        );
    }
    check("shm_direct", var, "0", "0", &[]);
    check("shm_direct", var, " 0", "0", &[]);
    check("shm_direct", var, "1", "1", &[]);
    check("shm_direct", var, "", "1", &[]);
}

#[test]
fn no_simd() {
    let var = "EPCOMM_NO_SIMD";
    for bad in ["yes", "on"] {
        check(
            "no_simd",
            var,
            bad,
            "1",
            &[&invalid(var, bad, "0 or 1", "1")],
        );
    }
    check("no_simd", var, "1", "1", &[]);
    check("no_simd", var, "0", "0", &[]);
    check("no_simd", var, "", "0", &[]);
}

#[test]
fn fault_point() {
    let var = "EPCOMM_FAULT_POINT";
    let expected = "one of join, dispatch:before_counts, dispatch:after_counts, combine, \
                    eplb:before_staging, eplb:between_batches, eplb:after_staging";
    for bad in ["bogus", "Join", "dispatch"] {
        check(
            "fault_point",
            var,
            bad,
            "",
            &[&invalid(var, bad, expected, "no fault point")],
        );
    }
    check("fault_point", var, "", "", &[]);
    // A valid point: the child kills itself there, silently.
    for point in ["join", "combine"] {
        let (_, o) = run_child(
            "child",
            &[(CHILD, "fault_point".into()), (var, point.into())],
        );
        assert_eq!(o.status.signal(), Some(libc::SIGKILL), "{point}: {o:?}");
        assert_eq!(String::from_utf8_lossy(&o.stderr), "", "{point}");
    }
}

#[test]
fn nvrtc_path() {
    let var = "EPCOMM_NVRTC_PATH";
    let bad = OsString::from_vec(b"/nonexistent/\xff".to_vec());
    check(
        "nvrtc_path",
        var,
        bad,
        "",
        &[&invalid(
            var,
            "/nonexistent/\u{fffd}",
            "a UTF-8 path to libnvrtc.so.* or its directory",
            "the default search",
        )],
    );
    // Any UTF-8 path is taken as given (the loader reports one that holds no NVRTC).
    check("nvrtc_path", var, " /opt/nv rtc ", " /opt/nv rtc ", &[]);
    check("nvrtc_path", var, "", "", &[]);
}

#[test]
fn cache_dir() {
    let var = "EPCOMM_CACHE_DIR";
    check(
        "cache_dir",
        var,
        "/tmp/epcomm cache",
        "/tmp/epcomm cache",
        &[],
    );
}

#[test]
fn nvrtc_lineinfo() {
    let var = "EPCOMM_NVRTC_LINEINFO";
    check(
        "nvrtc_lineinfo",
        var,
        "yes",
        "0",
        &[&invalid(var, "yes", "0 or 1", "0")],
    );
    check("nvrtc_lineinfo", var, "1", "1", &[]);
    check("nvrtc_lineinfo", var, "0", "0", &[]);
    check("nvrtc_lineinfo", var, "", "0", &[]);
}
