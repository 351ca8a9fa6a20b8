//! The capability probe (`epcomm_cuda_caps`): what this process can use on the GPU path — the
//! CUDA driver and its devices (compute capability, SMs, VMM / POSIX-fd / fabric handles,
//! compute mode, IPC events), NCCL and NVRTC (versions and the files actually loaded).
//!
//! The probe never fails: without CUDA (or without the `cuda` feature) it reports
//! `"cuda": {"available": false, "reason": "..."}`, and likewise for NCCL and NVRTC. Transports
//! read it to refuse early with a clear message.

use std::ffi::{c_void, CStr};

use serde_json::{json, Value};

use crate::probe::{self, Library};

/// One device's capabilities.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DeviceCaps {
    /// The device ordinal.
    pub ordinal: usize,
    /// The device name.
    pub name: String,
    /// (major, minor).
    pub compute_capability: (i32, i32),
    /// Streaming multiprocessors.
    pub sm_count: i32,
    /// `CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED`.
    pub vmm: bool,
    /// `CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED`.
    pub posix_fd: bool,
    /// `CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED` (needs IMEX; multi-node NVLink).
    pub fabric: bool,
    /// `CU_DEVICE_ATTRIBUTE_COMPUTE_MODE` (0 default, 2 prohibited, 3 exclusive process).
    pub compute_mode: i32,
    /// `CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED`.
    pub ipc_event: bool,
    /// `CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING` (legacy IPC needs it).
    pub unified_addressing: bool,
    /// The first query that failed, if any (the other fields are then partly defaults).
    pub error: Option<String>,
}

impl DeviceCaps {
    /// The compute mode's name.
    fn compute_mode_name(&self) -> &'static str {
        match self.compute_mode {
            0 => "default",
            1 => "exclusive_thread",
            2 => "prohibited",
            3 => "exclusive_process",
            _ => "unknown",
        }
    }
}

/// The CUDA driver's capabilities.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CudaCaps {
    /// Whether the driver loaded and initialised.
    pub available: bool,
    /// Why not, when not available.
    pub reason: Option<String>,
    /// `cuDriverGetVersion` (e.g. 12080).
    pub driver_version: Option<i32>,
    /// The libcuda file loaded.
    pub driver_path: Option<String>,
    /// Every visible device.
    pub devices: Vec<DeviceCaps>,
}

/// A dlopen'd library's availability, version and file.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LibCaps {
    /// Whether the library loaded and answered its version call.
    pub available: bool,
    /// Why not, when not available.
    pub reason: Option<String>,
    /// Human-readable version ("2.28.9", "12.8").
    pub version: Option<String>,
    /// The numeric version code where the library has one (NCCL: 22809).
    pub version_code: Option<i32>,
    /// The file actually loaded (`dladdr`), else the name that opened it.
    pub path: Option<String>,
}

impl LibCaps {
    fn unavailable(reason: String) -> LibCaps {
        LibCaps {
            reason: Some(reason),
            ..LibCaps::default()
        }
    }
}

/// Everything the probe found.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Caps {
    /// Built with the `cuda` feature.
    pub feature_cuda: bool,
    /// Built with the `nccl` feature.
    pub feature_nccl: bool,
    /// The CUDA driver and devices.
    pub cuda: CudaCaps,
    /// NCCL.
    pub nccl: LibCaps,
    /// NVRTC.
    pub nvrtc: LibCaps,
    /// How the NVRTC was chosen for the driver, when one was.
    pub nvrtc_choice: Option<NvrtcChoice>,
}

/// Which NVRTC [`crate::gpu::nvrtc::choose`] took for the driver, and why.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NvrtcChoice {
    /// `cuDriverGetVersion`, when known.
    pub driver_version: Option<i32>,
    /// Why the driver version is unknown.
    pub driver_unknown: Option<String>,
    /// Every NVRTC found, in search order.
    pub candidates: Vec<crate::gpu::nvrtc::Candidate>,
    /// Why the chosen one.
    pub reason: String,
}

/// The file a symbol was loaded from (`dladdr`).
fn file_of(sym: *mut c_void) -> Option<String> {
    // SAFETY: Dl_info is plain data; dladdr only reads the address.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: `info` is writable; `sym` is any address.
    if unsafe { libc::dladdr(sym, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dli_fname is a NUL-terminated string owned by the loader.
    Some(
        unsafe { CStr::from_ptr(info.dli_fname) }
            .to_string_lossy()
            .into_owned(),
    )
}

fn lib_path(lib: &Library, sym: &str) -> String {
    lib.symbol(sym)
        .and_then(file_of)
        .unwrap_or_else(|| lib.name.to_owned())
}

fn probe_nccl() -> LibCaps {
    match crate::gpu::nccl::api() {
        Ok(api) => {
            let (ma, mi, pa) = crate::gpu::nccl::version_parts(api.version);
            LibCaps {
                available: true,
                reason: None,
                version: Some(format!("{ma}.{mi}.{pa}")),
                version_code: Some(api.version),
                path: Some(lib_path(&api.lib, "ncclGetVersion")),
            }
        }
        // The API's message is "NCCL is unavailable: {why}"; the JSON wants the why.
        Err(e) => {
            let msg = e.to_string();
            let why = msg
                .strip_prefix("NCCL is unavailable: ")
                .unwrap_or(&msg)
                .to_owned();
            LibCaps::unavailable(why)
        }
    }
}

/// NVRTC through the same loader and choice the compiler uses
/// ([`crate::gpu::nvrtc::Nvrtc::global_selection`]): `EPCOMM_NVRTC_PATH` when set, else
/// `libnvrtc.so.13`/`.12`/`libnvrtc.so`; of those, the newest whose major the driver runs
/// (cudarc's `cuda-12080` list never tries `.13`, the only NVRTC of a cu13 torch). Found once
/// per process.
fn probe_nvrtc() -> (LibCaps, Option<NvrtcChoice>) {
    match crate::gpu::nvrtc::Nvrtc::global_selection() {
        Ok(sel) => {
            let (ma, mi) = sel.nvrtc.version;
            let lib = LibCaps {
                available: true,
                reason: None,
                version: Some(format!("{ma}.{mi}")),
                version_code: Some(ma * 1000 + mi * 10),
                path: Some(sel.nvrtc.path.to_owned()),
            };
            let choice = NvrtcChoice {
                driver_version: sel.driver_version.as_ref().ok().copied(),
                driver_unknown: sel.driver_version.as_ref().err().cloned(),
                candidates: sel.candidates.clone(),
                reason: sel.choice.reason.clone(),
            };
            (lib, Some(choice))
        }
        Err(e) => (LibCaps::unavailable(e.to_string()), None),
    }
}

#[cfg(feature = "cuda")]
fn probe_device(ordinal: usize) -> DeviceCaps {
    use crate::gpu::driver::{Device, DeviceAttribute as A};
    let mut d = DeviceCaps {
        ordinal,
        ..DeviceCaps::default()
    };
    let r = (|| -> crate::error::Result<()> {
        let dev = Device::get(ordinal)?;
        d.name = dev.name()?;
        d.compute_capability = dev.compute_capability()?;
        d.sm_count = dev.sm_count()?;
        d.compute_mode = dev.attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_MODE)?;
        d.unified_addressing = dev.attribute(A::CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING)? != 0;
        d.vmm = dev.attribute(A::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED)? != 0;
        d.posix_fd =
            dev.attribute(A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)? != 0;
        d.ipc_event = dev.attribute(A::CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED)? != 0;
        // Older drivers reject attribute 128 with INVALID_VALUE: that means "no fabric".
        d.fabric = dev
            .attribute(A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED)
            .map(|v| v != 0)
            .unwrap_or(false);
        Ok(())
    })();
    if let Err(e) = r {
        d.error = Some(e.to_string());
    }
    d
}

#[cfg(feature = "cuda")]
fn probe_cuda() -> CudaCaps {
    use crate::gpu::driver;
    let lib = match probe::cuda() {
        Ok(lib) => lib,
        Err(e) => {
            return CudaCaps {
                reason: Some(e),
                ..CudaCaps::default()
            }
        }
    };
    let r = (|| -> crate::error::Result<CudaCaps> {
        driver::init()?;
        let version = driver::driver_version()?;
        let n = driver::device_count()?;
        Ok(CudaCaps {
            available: true,
            reason: None,
            driver_version: Some(version),
            driver_path: Some(lib_path(&lib, "cuInit")),
            devices: (0..n).map(probe_device).collect(),
        })
    })();
    r.unwrap_or_else(|e| CudaCaps {
        reason: Some(e.to_string()),
        driver_path: Some(lib_path(&lib, "cuInit")),
        ..CudaCaps::default()
    })
}

#[cfg(not(feature = "cuda"))]
fn probe_cuda() -> CudaCaps {
    CudaCaps {
        reason: Some(
            probe::cuda()
                .err()
                .unwrap_or_else(|| "epcomm was built without the 'cuda' feature".into()),
        ),
        ..CudaCaps::default()
    }
}

/// Probes everything. Never fails; a panic from a driver library is caught and reported as
/// the reason.
pub fn probe() -> Caps {
    let cuda = std::panic::catch_unwind(probe_cuda).unwrap_or_else(|_| CudaCaps {
        reason: Some("the CUDA driver probe panicked (see stderr)".into()),
        ..CudaCaps::default()
    });
    let (nvrtc, nvrtc_choice) = probe_nvrtc();
    Caps {
        feature_cuda: cfg!(feature = "cuda"),
        feature_nccl: cfg!(feature = "nccl"),
        cuda,
        nccl: probe_nccl(),
        nvrtc,
        nvrtc_choice,
    }
}

fn lib_json(l: &LibCaps) -> Value {
    if !l.available {
        return json!({ "available": false, "reason": l.reason });
    }
    json!({
        "available": true,
        "version": l.version,
        "version_code": l.version_code,
        "path": l.path,
    })
}

/// `{"driver_version_code": 12080 | null, "driver_unknown": null | "why", "candidates":
/// [{"name", "major", "already_loaded"}], "reason": "..."}`.
fn choice_json(c: &NvrtcChoice) -> Value {
    let candidates: Vec<Value> = c
        .candidates
        .iter()
        .map(|k| json!({ "name": k.name, "major": k.major, "already_loaded": k.loaded }))
        .collect();
    json!({
        "driver_version_code": c.driver_version,
        "driver_unknown": c.driver_unknown,
        "candidates": candidates,
        "reason": c.reason,
    })
}

impl Caps {
    /// The JSON form (what `epcomm_cuda_caps` returns):
    /// `{"features": {...}, "cuda": {...}, "nccl": {...}, "nvrtc": {...}}`; each unavailable
    /// part is `{"available": false, "reason": "..."}` (for NVRTC also a driver mismatch,
    /// naming both versions); an available NVRTC has `"choice"`: which library for which
    /// driver and why.
    pub fn to_json(&self) -> Value {
        let cuda = if self.cuda.available {
            let devices: Vec<Value> = self
                .cuda
                .devices
                .iter()
                .map(|d| {
                    json!({
                        "ordinal": d.ordinal,
                        "name": d.name,
                        "compute_capability": format!("{}.{}", d.compute_capability.0, d.compute_capability.1),
                        "sm_count": d.sm_count,
                        "vmm": d.vmm,
                        "posix_fd": d.posix_fd,
                        "fabric": d.fabric,
                        "compute_mode": d.compute_mode_name(),
                        "ipc_event": d.ipc_event,
                        "unified_addressing": d.unified_addressing,
                        "error": d.error,
                    })
                })
                .collect();
            let v = self.cuda.driver_version.unwrap_or(0);
            json!({
                "available": true,
                "driver_version": format!("{}.{}", v / 1000, (v % 1000) / 10),
                "driver_version_code": v,
                "driver_path": self.cuda.driver_path,
                "device_count": devices.len(),
                "devices": devices,
            })
        } else {
            json!({ "available": false, "reason": self.cuda.reason })
        };
        let mut nccl = lib_json(&self.nccl);
        if let (Some(code), Some(obj)) = (self.nccl.version_code, nccl.as_object_mut()) {
            obj.insert(
                "zero_size_p2p".into(),
                Value::Bool(crate::gpu::nccl::supports_zero_size_p2p(code)),
            );
        }
        let mut nvrtc = lib_json(&self.nvrtc);
        if let (Some(c), Some(obj)) = (&self.nvrtc_choice, nvrtc.as_object_mut()) {
            obj.insert("choice".into(), choice_json(c));
        }
        json!({
            "features": { "cuda": self.feature_cuda, "nccl": self.feature_nccl },
            "cuda": cuda,
            "nccl": nccl,
            "nvrtc": nvrtc,
        })
    }

    /// The JSON as a compact string.
    pub fn to_json_string(&self) -> String {
        self.to_json().to_string()
    }
}
