//! The EPLB communicator factory over its whole input matrix (vLLM's `create_eplb_communicator`,
//! docs/design.md section 7): requested name (automatic, the five names, an unknown one) ×
//! elastic group × device (cpu, cuda, xpu) × NCCL usable × NIXL present. The expected outcome of every
//! combination is computed here from those rules, written out independently of
//! `epcomm::select::eplb`, and `select` must agree exactly: communicator, warnings, error message
//! and exception class. `communicator::create` must build what select chose where this build can
//! (torch_gloo; torch_nccl and torch_xccl on host tensors), report the unimplemented GPU transports otherwise, and
//! fail with select's exact error when select fails.

mod common;
mod ranks;

use std::sync::{Arc, Mutex};

use epcomm::dtype::DType;
use epcomm::eplb::communicator;
use epcomm::log::{self, Level};
use epcomm::select::eplb::{self, Communicator, DeviceKind, SelectRequest};
use epcomm::{Error, Status};

const REQUESTED: [Option<&str>; 8] = [
    None,
    Some("torch_nccl"),
    Some("torch_gloo"),
    Some("torch_xccl"),
    Some("pynccl"),
    Some("nixl"),
    Some("symm_mem"),
    Some("bogus"),
];
const DEVICES: [DeviceKind; 3] = [DeviceKind::Cpu, DeviceKind::Cuda, DeviceKind::Xpu];
/// Dtypes NCCL moves on CUDA, so the pynccl dtype check never fires in this matrix.
const WEIGHT_DTYPES: [DType; 2] = [DType::F32, DType::BF16];

const W_FORCED: &str =
    "Stateless elastic EP requires PyNCCL backend. Forcing EPLB communicator to 'pynccl'.";

/// What vLLM's factory rules give for one combination.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Expected {
    Built {
        communicator: Communicator,
        warnings: Vec<String>,
    },
    Failed {
        exception: &'static str,
        message: String,
    },
}

fn value_error(message: String) -> Expected {
    Expected::Failed {
        exception: "ValueError",
        message,
    }
}

fn runtime_error(message: &str) -> Expected {
    Expected::Failed {
        exception: "RuntimeError",
        message: message.to_owned(),
    }
}

/// PyTorch's `device.type` for the devices of the matrix.
fn device_type(device: DeviceKind) -> &'static str {
    match device {
        DeviceKind::Cpu => "cpu",
        DeviceKind::Cuda => "cuda",
        DeviceKind::Xpu => "xpu",
        other => panic!("not in the matrix: {other:?}"),
    }
}

/// Rule 2: building pynccl (host tensors, then NCCL; dtypes are all supported here).
fn build_pynccl(device: DeviceKind, nccl: bool, warnings: Vec<String>) -> Expected {
    if device == DeviceKind::Cpu {
        return runtime_error(&format!(
            "EPLB communicator 'pynccl' supports only cuda-like devices (got {}).",
            device_type(device)
        ));
    }
    if !nccl {
        return runtime_error("EPLB communicator 'pynccl' requested but unavailable.");
    }
    Expected::Built {
        communicator: Communicator::Pynccl,
        warnings,
    }
}

/// Rule 3: nixl (library first, then the device).
fn build_nixl(device: DeviceKind, nixl: bool) -> Expected {
    if !nixl {
        return runtime_error("EPLB communicator 'nixl' requested but NIXL is unavailable.");
    }
    // vLLM: `current_platform.is_cuda_alike() and tensor_device_type != "cpu"`.
    if device != DeviceKind::Cuda {
        return runtime_error(&format!(
            "EPLB communicator 'nixl' supports only cuda-like devices (got {}).",
            device_type(device)
        ));
    }
    Expected::Built {
        communicator: Communicator::Nixl,
        warnings: Vec::new(),
    }
}

/// vLLM's factory rules, in its order.
fn expected(
    requested: Option<&str>,
    elastic: bool,
    device: DeviceKind,
    nccl: bool,
    nixl: bool,
) -> Expected {
    // Auto-selection: XPU → torch_xccl; NIXL available → nixl; elastic → pynccl; else torch_gloo.
    let name = requested.unwrap_or(if device == DeviceKind::Xpu {
        "torch_xccl"
    } else if nixl {
        "nixl"
    } else if elastic {
        "pynccl"
    } else {
        "torch_gloo"
    });
    // 1. Elastic (stateless) group.
    if elastic {
        match name {
            "nixl" => return build_nixl(device, nixl),
            "torch_nccl" => return build_pynccl(device, nccl, vec![W_FORCED.to_owned()]),
            "pynccl" => return build_pynccl(device, nccl, Vec::new()),
            other => {
                return value_error(format!(
                    "Elastic EP requires 'torch_nccl', 'pynccl', or 'nixl' EPLB communicator (got '{other}')."
                ))
            }
        }
    }
    // 3. and 4.
    match name {
        "nixl" => build_nixl(device, nixl),
        "torch_gloo" => Expected::Built {
            communicator: Communicator::TorchGloo,
            warnings: Vec::new(),
        },
        "torch_xccl" => Expected::Built {
            communicator: Communicator::TorchXccl,
            warnings: Vec::new(),
        },
        "torch_nccl" => Expected::Built {
            communicator: Communicator::TorchNccl,
            warnings: Vec::new(),
        },
        "pynccl" => build_pynccl(device, nccl, Vec::new()),
        // vLLM 0.34.0's push backend: CUDA only in vLLM; host-staged in epcomm, whose CUDA
        // tensors it cannot push.
        "symm_mem" => match device {
            DeviceKind::Cpu => Expected::Built {
                communicator: Communicator::SymmMem,
                warnings: Vec::new(),
            },
            DeviceKind::Cuda => Expected::Failed {
                exception: "NotImplementedError",
                message: "EPLB communicator 'symm_mem' on cuda tensors (SymmMemEplbCommunicator: a push into the receivers' buffers over CUDA symmetric memory) is not implemented in epcomm; stage the expert weights in host memory (kDLCPU), where epcomm pushes into next buffers in shared memory, or use 'nixl' or 'torch_gloo'".into(),
            },
            DeviceKind::Rocm | DeviceKind::Xpu | DeviceKind::Other(_) => {
                value_error("symm_mem EPLB requires CUDA".into())
            }
        },
        other => value_error(format!("Unknown EPLB communicator backend: {other}")),
    }
}

/// One combination of the matrix, with a printable label.
struct Case {
    label: String,
    requested: Option<&'static str>,
    elastic: bool,
    device: DeviceKind,
    nccl: bool,
    nixl: bool,
}

/// Every combination of the matrix.
fn matrix() -> Vec<Case> {
    let mut v = Vec::new();
    for requested in REQUESTED {
        for elastic in [false, true] {
            for device in DEVICES {
                for nccl in [false, true] {
                    for nixl in [false, true] {
                        let label = format!(
                            "requested={requested:?} elastic={elastic} device={device:?} nccl={nccl} nixl={nixl}"
                        );
                        v.push(Case {
                            label,
                            requested,
                            elastic,
                            device,
                            nccl,
                            nixl,
                        });
                    }
                }
            }
        }
    }
    assert_eq!(v.len(), 8 * 2 * 3 * 2 * 2);
    v
}

fn request(
    requested: Option<&str>,
    elastic: bool,
    device: DeviceKind,
    nccl: bool,
    nixl: bool,
) -> SelectRequest<'_> {
    SelectRequest {
        requested,
        elastic,
        device,
        weight_dtypes: &WEIGHT_DTYPES,
        nccl_available: nccl,
        nixl_available: nixl,
    }
}

/// A few combinations spelled out by hand, so the model above is itself checked against the
/// rules as written rather than only against the implementation.
#[test]
fn the_model_matches_hand_written_cases() {
    use Expected::*;
    let gloo = Built {
        communicator: Communicator::TorchGloo,
        warnings: vec![],
    };
    assert_eq!(
        expected(None, false, DeviceKind::Cpu, false, false),
        gloo.clone()
    );
    assert_eq!(expected(None, false, DeviceKind::Cuda, true, false), gloo);
    assert_eq!(
        expected(None, true, DeviceKind::Cuda, true, false),
        Built {
            communicator: Communicator::Pynccl,
            warnings: vec![]
        }
    );
    assert_eq!(
        expected(None, true, DeviceKind::Cuda, false, true),
        Built {
            communicator: Communicator::Nixl,
            warnings: vec![]
        }
    );
    assert_eq!(
        expected(None, false, DeviceKind::Cpu, true, true),
        runtime_error("EPLB communicator 'nixl' supports only cuda-like devices (got cpu).")
    );
    assert_eq!(
        expected(Some("torch_nccl"), true, DeviceKind::Cuda, true, false),
        Built {
            communicator: Communicator::Pynccl,
            warnings: vec![W_FORCED.to_owned()]
        }
    );
    assert_eq!(
        expected(Some("torch_nccl"), true, DeviceKind::Cpu, true, false),
        runtime_error("EPLB communicator 'pynccl' supports only cuda-like devices (got cpu).")
    );
    assert_eq!(
        expected(Some("pynccl"), false, DeviceKind::Cuda, false, true),
        runtime_error("EPLB communicator 'pynccl' requested but unavailable.")
    );
    assert_eq!(
        expected(Some("nixl"), true, DeviceKind::Cpu, true, false),
        runtime_error("EPLB communicator 'nixl' requested but NIXL is unavailable.")
    );
    assert_eq!(
        expected(Some("torch_gloo"), true, DeviceKind::Cpu, true, true),
        value_error(
            "Elastic EP requires 'torch_nccl', 'pynccl', or 'nixl' EPLB communicator (got 'torch_gloo')."
                .into()
        )
    );
    // Unknown names: the elastic rule comes first.
    assert_eq!(
        expected(Some("bogus"), true, DeviceKind::Cuda, true, true),
        value_error(
            "Elastic EP requires 'torch_nccl', 'pynccl', or 'nixl' EPLB communicator (got 'bogus')."
                .into()
        )
    );
    assert_eq!(
        expected(Some("bogus"), false, DeviceKind::Cuda, true, true),
        value_error("Unknown EPLB communicator backend: bogus".into())
    );
}

#[test]
fn select_follows_the_rules_for_every_combination() {
    let mut counts = [0usize; 2];
    for Case {
        label,
        requested,
        elastic,
        device,
        nccl,
        nixl,
    } in matrix()
    {
        let want = expected(requested, elastic, device, nccl, nixl);
        let got = eplb::select(&request(requested, elastic, device, nccl, nixl));
        match (&want, &got) {
            (
                Expected::Built {
                    communicator,
                    warnings,
                },
                Ok(sel),
            ) => {
                counts[0] += 1;
                assert_eq!(sel.communicator, *communicator, "{label}");
                assert_eq!(&sel.warnings, warnings, "{label}");
                assert_eq!(sel.auto_selected, requested.is_none(), "{label}");
            }
            (Expected::Failed { exception, message }, Err(e)) => {
                counts[1] += 1;
                assert_eq!(&e.to_string(), message, "{label}");
                assert_eq!(e.exception(), *exception, "{label}");
                assert_eq!(
                    e.status().exception(),
                    Some(*exception),
                    "{label}: the C status maps to the same exception class"
                );
            }
            _ => panic!("{label}: expected {want:?}, select gave {got:?}"),
        }
    }
    // Both outcomes are well represented.
    assert!(counts[0] >= 20 && counts[1] >= 40, "{counts:?}");
}

#[test]
fn create_builds_what_select_chose_or_fails_like_it() {
    let seen: Arc<Mutex<Vec<(Level, String)>>> = Arc::default();
    let sink = seen.clone();
    log::set_sink(Some(Arc::new(move |l, m| {
        sink.lock().unwrap().push((l, m.to_owned()))
    })));
    let mut built = 0usize;
    for Case {
        label,
        requested,
        elastic,
        device,
        nccl,
        nixl,
    } in matrix()
    {
        seen.lock().unwrap().clear();
        let sel = eplb::select(&request(requested, elastic, device, nccl, nixl));
        let got = communicator::create(requested, elastic, device, &WEIGHT_DTYPES, nccl, nixl);
        let logs = std::mem::take(&mut *seen.lock().unwrap());
        let warned: Vec<(Level, String)> = sel
            .as_ref()
            .map(|s| {
                s.warnings
                    .iter()
                    .map(|w| (Level::Warn, w.clone()))
                    .collect()
            })
            .unwrap_or_default();
        match sel {
            Ok(sel) => {
                let c = sel.communicator;
                let builds = c == Communicator::TorchGloo
                    || (matches!(
                        c,
                        Communicator::TorchNccl | Communicator::TorchXccl | Communicator::SymmMem
                    ) && device == DeviceKind::Cpu);
                if builds {
                    built += 1;
                    let comm = got.unwrap_or_else(|e| panic!("{label}: create failed: {e}"));
                    assert_eq!(comm.kind(), c, "{label}");
                    let mut want = warned.clone();
                    want.push((
                        Level::Info,
                        format!("Initialized EPLB communicator: {}.", c.class_name()),
                    ));
                    assert_eq!(logs, want, "{label}: logs");
                    continue;
                }
                let e = match got {
                    Ok(comm) => panic!("{label}: create built {comm:?}; expected an error"),
                    Err(e) => e,
                };
                match c {
                    Communicator::TorchXccl => {
                        assert_ne!(device, DeviceKind::Cpu, "{label}");
                        assert_eq!(
                            e.to_string(),
                            format!("EPLB communicator 'torch_xccl' on {} tensors needs XCCL device P2P, which epcomm does not have; stage the expert weights in host memory (kDLCPU) and epcomm moves them over the group", device_type(device)),
                            "{label}"
                        );
                        assert_eq!(e.exception(), "NotImplementedError", "{label}");
                    }
                    Communicator::TorchNccl => {
                        assert_ne!(device, DeviceKind::Cpu, "{label}");
                        assert!(matches!(e, Error::NotImplemented(_)), "{label}: {e:?}");
                        assert_eq!(e.status(), Status::NotImplemented, "{label}");
                        assert_eq!(e.exception(), "NotImplementedError", "{label}");
                        assert!(e.to_string().contains("'torch_nccl'"), "{label}: {e}");
                    }
                    Communicator::Pynccl => {
                        assert_eq!(
                            e.to_string(),
                            "Failed to initialize PyNcclEplbCommunicator (epcomm's NCCL transport is not implemented yet).",
                            "{label}"
                        );
                        assert_eq!(e.status(), Status::Runtime, "{label}");
                        assert_eq!(e.exception(), "RuntimeError", "{label}");
                    }
                    Communicator::Nixl => {
                        let m = e.to_string();
                        assert!(
                            m.starts_with("Failed to initialize NixlEplbCommunicator (")
                                && m.ends_with(")."),
                            "{label}: {m}"
                        );
                        assert_eq!(e.status(), Status::Runtime, "{label}");
                        assert_eq!(e.exception(), "RuntimeError", "{label}");
                    }
                    Communicator::TorchGloo => unreachable!("torch_gloo always builds"),
                    Communicator::SymmMem => {
                        unreachable!("symm_mem is selected for host tensors only")
                    }
                }
                // The factory's warnings (e.g. forced to pynccl) come before the construction
                // failure, as in vLLM; nothing is announced as initialized.
                assert_eq!(logs, warned, "{label}: logs");
            }
            Err(select_error) => {
                let e = match got {
                    Ok(comm) => panic!("{label}: create built {comm:?}; select failed"),
                    Err(e) => e,
                };
                assert_eq!(e, select_error, "{label}: create's error is select's");
                assert_eq!(e.to_string(), select_error.to_string(), "{label}");
                assert_eq!(e.exception(), select_error.exception(), "{label}");
                assert_eq!(e.status(), select_error.status(), "{label}");
                assert!(
                    !logs.iter().any(|(_, m)| m.starts_with("Initialized EPLB")),
                    "{label}: {logs:?}"
                );
            }
        }
    }
    log::set_sink(None);
    // torch_gloo: explicit, never elastic, 3 devices x 2 x 2; automatic without NIXL off XPU,
    // not elastic: 2 devices x 2; torch_nccl, torch_xccl and symm_mem on cpu, not elastic: 4
    // each.
    assert_eq!(built, 12 + 4 + 4 + 4 + 4, "combinations that build");
}

/// Every communicator that builds on host tensors moves the weights: a two-rank rearrangement
/// over shared memory through each lands every row where the new placement says.
#[test]
fn host_communicators_move_the_weights() {
    use common::eplb_fixture::{self, Weights};
    use epcomm::eplb::rearrange::rearrange;
    use epcomm::group::shm::ShmGroup;
    use epcomm::group::GroupOptions;

    const ROW_BYTES: [usize; 2] = [16, 40];
    let world = 2;
    let old = eplb_fixture::modulo_placement(2, 8, 6);
    let load = eplb_fixture::skewed_load(2, 6, 3, 0.0);
    let new = eplb_fixture::rebalanced(&load, 8, world);
    assert_ne!(old, new);
    let weights = Weights {
        world,
        row_bytes: &ROW_BYTES,
    };
    for name in ["torch_gloo", "torch_nccl", "torch_xccl"] {
        let group = ranks::unique("f", "h");
        let (old, to) = (old.clone(), new.clone());
        let got = ranks::on_threads(world, move |r| {
            let opts = GroupOptions {
                timeout: std::time::Duration::from_secs(20),
                ..GroupOptions::default()
            };
            let mut g = ShmGroup::join(&group, r, world, opts).unwrap();
            let mut c = communicator::create(Some(name), false, DeviceKind::Cpu, &[], false, false)
                .unwrap();
            assert_eq!(c.kind().name(), name);
            let mut w = weights.all(&old, r);
            let mut views = eplb_fixture::views(&mut w);
            rearrange(&mut g, c.as_mut(), &old, &to, &mut views, &ROW_BYTES, None).unwrap();
            drop(views);
            w
        });
        for (r, w) in got.iter().enumerate() {
            assert_eq!(w, &weights.all(&new, r), "{name}: rank {r}");
        }
    }
}
