//! A stand-in for libnccl.so.2 whose communicators are non-blocking (created with
//! `blocking = 0`, or a host's): `ncclCommInitRankConfig`, collectives and the outermost
//! `ncclGroupEnd` answer `ncclInProgress` (7) and the work completes after
//! `ncclCommGetAsyncError` was polled three more times (or never, with `FAKE_STUCK` set). Every
//! call is logged (`fake_nccl_log()`), polls as `poll;`.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// The C source.
pub const FAKE_NONBLOCKING_NCCL_C: &str = r#"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
typedef struct { char internal[128]; } ncclUniqueId;
static char logbuf[65536];
static size_t loglen;
static void logs(const char *s) {
    size_t n = strlen(s);
    if (loglen + n < sizeof logbuf) { memcpy(logbuf + loglen, s, n); loglen += n; logbuf[loglen] = 0; }
}
const char *fake_nccl_log(void) { return logbuf; }
static int pending, depth, comm_state[2] = {2, 1};
static int queued(void) { pending = 3; return 7; }
int ncclGetVersion(int *v) { *v = 22304; return 0; }
int ncclGetUniqueId(ncclUniqueId *id) { memset(id, 0, sizeof *id); return 0; }
int ncclCommInitRank(void **comm, int n, ncclUniqueId id, int rank) {
    (void)id; comm_state[0] = n; comm_state[1] = rank; *comm = comm_state; logs("init;"); return 0;
}
/* The NCCL 2.14 ncclConfig_t prefix: size, magic, version, blocking, ... */
typedef struct { size_t size; unsigned magic, version; int blocking, cga, min_ctas, max_ctas; const char *net; } cfg_t;
int ncclCommInitRankConfig(void **comm, int n, ncclUniqueId id, int rank, cfg_t *cfg) {
    char b[96]; (void)id;
    if (cfg->magic != 0xcafebeef || cfg->size < 20) return 4;
    comm_state[0] = n; comm_state[1] = rank; *comm = comm_state;
    snprintf(b, sizeof b, "initcfg %zu %u %d %d;", cfg->size, cfg->version, cfg->blocking, cfg->cga); logs(b);
    return cfg->blocking == 0 ? queued() : 0;
}
int ncclCommDestroy(void *c) { (void)c; logs("destroy;"); return 0; }
int ncclCommAbort(void *c) { (void)c; logs("abort;"); return 0; }
int ncclCommGetAsyncError(void *c, int *e) {
    (void)c; logs("poll;");
    if (getenv("FAKE_STUCK")) { *e = 7; return 0; }
    if (pending > 0) { --pending; *e = 7; return 0; }
    *e = getenv("FAKE_ASYNC") ? 6 : 0;
    return 0;
}
int ncclCommCount(void *c, int *n) { *n = ((int *)c)[0]; return 0; }
int ncclCommUserRank(void *c, int *r) { *r = ((int *)c)[1]; return 0; }
int ncclAllGather(const void *s, void *r, size_t n, int dt, void *c, void *st) {
    (void)s; (void)r; (void)n; (void)dt; (void)c; (void)st; logs("allgather;"); return queued();
}
/* Inside a group a non-blocking communicator may already answer ncclInProgress. */
int ncclSend(const void *p, size_t n, int dt, int peer, void *c, void *st) {
    (void)p; (void)n; (void)dt; (void)peer; (void)c; (void)st; logs("send;"); return 7;
}
int ncclRecv(void *p, size_t n, int dt, int peer, void *c, void *st) {
    (void)p; (void)n; (void)dt; (void)peer; (void)c; (void)st; logs("recv;"); return 0;
}
int ncclGroupStart(void) { ++depth; logs("gs;"); return 0; }
int ncclGroupEnd(void) { logs("ge;"); return --depth == 0 ? queued() : 0; }
const char *ncclGetErrorString(int r) {
    switch (r) {
    case 0: return "no error";
    case 6: return "remote process exited or there was a network error";
    case 7: return "NCCL operation in progress";
    default: return "unhandled error";
    }
}
const char *ncclGetLastError(void *c) { (void)c; return ""; }
"#;

/// Builds the fake into `dir` with `$CC` (default `cc`): the library, or why it could not.
pub fn build(dir: &Path) -> Result<PathBuf, String> {
    let src = dir.join("fake_nonblocking_nccl.c");
    let lib = dir.join("libnccl-nonblocking.so.2");
    std::fs::write(&src, FAKE_NONBLOCKING_NCCL_C).map_err(|e| e.to_string())?;
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    match std::process::Command::new(&cc)
        .args(["-shared", "-fPIC", "-O0", "-o"])
        .arg(&lib)
        .arg(&src)
        .status()
    {
        Ok(s) if s.success() => Ok(lib),
        Ok(s) => Err(format!("{cc} exited with {s}; install gcc or set $CC")),
        Err(e) => Err(format!("cannot run {cc} ({e}); install gcc or set $CC")),
    }
}

/// The fake's call log (the library is loaded in this process).
pub fn log(path: &str) -> String {
    let c = std::ffi::CString::new(path).unwrap();
    // SAFETY: the fake library is already loaded (RTLD_NOLOAD) and exports
    // `const char *fake_nccl_log(void)`.
    unsafe {
        let h = libc::dlopen(c.as_ptr(), libc::RTLD_NOLOAD | libc::RTLD_LAZY);
        assert!(!h.is_null(), "the fake NCCL is not loaded");
        let f = libc::dlsym(h, c"fake_nccl_log".as_ptr());
        assert!(!f.is_null());
        let f: extern "C" fn() -> *const libc::c_char = std::mem::transmute(f);
        std::ffi::CStr::from_ptr(f()).to_string_lossy().into_owned()
    }
}
