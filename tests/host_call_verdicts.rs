//! Inside one dispatch or combine over a host transport, the ops leave their verdicts to the
//! next op's header or to the call's close (`Group::open_call`): a host all_to_allv that
//! fails, or delivers garbage, on one rank at any of the call's exchanges (the routing, the
//! rows there, the rows back) still fails that call on every rank, with the same status, the
//! liar naming what it got and every other rank naming the liar; never OK with wrong data,
//! and the group is unusable on every rank afterwards. Ranks are threads over in-process
//! channels with bounded receives (a bug fails the test, never hangs it).

#[path = "common/channel.rs"]
mod channel;

use channel::{channel_transports_with, on_transports, ChannelTransport};
use epcomm::group::host::{HostGroup, HostTransport};
use epcomm::moe::{Manager, MoeConfig};
use epcomm::num::FloatKind;
use epcomm::Status;

const HIDDEN: usize = 8;
const K: usize = 2;
/// Tokens per rank: 64 carry 1.5 KiB of routing, more than a header holds, so a dispatch makes
/// three exchanges of its own (routing, rows) plus combine's one: three all_to_allv per step.
const TOKENS: usize = 64;

/// How the liar's all_to_allv goes wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lie {
    /// The host reports an error (after moving the data: the peers' calls succeed).
    Fails,
    /// The host delivers garbage into the receive buffer.
    Garbage,
}

/// A channel transport whose all_to_allv number `at` (counting from 0) goes wrong as `lie`.
struct Liar {
    inner: ChannelTransport,
    lie: Option<Lie>,
    at: usize,
    calls: usize,
}

impl HostTransport for Liar {
    fn send(&mut self, peer: usize, data: &[u8]) -> Result<(), String> {
        self.inner.send(peer, data)
    }
    fn recv(&mut self, peer: usize, data: &mut [u8]) -> Result<(), String> {
        self.inner.recv(peer, data)
    }
    fn all_gather(&mut self, mine: &[u8], out: &mut [u8]) -> Option<Result<(), String>> {
        self.inner.all_gather(mine, out)
    }
    fn all_to_allv(
        &mut self,
        send: &[u8],
        send_sizes: &[usize],
        recv: &mut [u8],
        recv_sizes: &[usize],
    ) -> Option<Result<(), String>> {
        let n = self.calls;
        self.calls += 1;
        let got = self.inner.all_to_allv(send, send_sizes, recv, recv_sizes)?;
        Some(got.and_then(|()| match self.lie.filter(|_| n == self.at) {
            None => Ok(()),
            Some(Lie::Fails) => Err("connection reset by the test".into()),
            Some(Lie::Garbage) => {
                for (i, b) in recv.iter_mut().enumerate() {
                    *b = (i as u8).wrapping_mul(37) ^ 0xA5;
                }
                Ok(())
            }
        }))
    }
}

/// Each rank's outcome of the second dispatch + combine (the first is honest) with rank
/// `liar`'s all_to_allv number `at` going wrong, and of a dispatch after it.
fn outcomes(world: usize, liar: usize, lie: Lie, at: usize) -> Vec<(epcomm::Result<()>, Status)> {
    let transports = channel_transports_with(world, true, true)
        .into_iter()
        .enumerate()
        .map(|(r, inner)| Liar {
            inner,
            lie: (r == liar).then_some(lie),
            at,
            calls: 0,
        })
        .collect();
    on_transports(transports, move |rank, g: &mut HostGroup| {
        let experts = 2 * world;
        let cfg = MoeConfig {
            num_experts: experts,
            top_k: K,
            hidden: HIDDEN,
            hidden_dtype: FloatKind::F32.dtype(),
            expert_dtype: FloatKind::F32,
            out_dtype: FloatKind::F32,
            max_tokens_per_rank: TOKENS,
            extra_row_bytes: vec![],
            apply_router_weight_on_input: false,
        };
        let mut m = Manager::new("deepep_high_throughput", cfg, rank, world).unwrap();
        let x: Vec<f32> = (0..TOKENS * HIDDEN)
            .map(|i| (rank * 1000 + i) as f32)
            .collect();
        let ids: Vec<i64> = (0..TOKENS)
            .flat_map(|t| [(t % experts) as i64, ((t + 3) % experts) as i64])
            .collect();
        let w = vec![0.5f32; TOKENS * K];
        let step = |m: &mut Manager, g: &mut HostGroup| -> epcomm::Result<Vec<f32>> {
            let d = m.dispatch(g, epcomm::bytes::as_bytes(&x), &ids, &w, &[])?;
            let y: Vec<f32> = epcomm::bytes::to_vec::<f32>(d.hidden);
            let mut out = vec![0u8; TOKENS * HIDDEN * 4];
            m.combine(g, epcomm::bytes::as_bytes(&y), &mut out)?;
            Ok(epcomm::bytes::to_vec(&out))
        };
        let honest = step(&mut m, g).expect("the honest first step");
        let got =
            step(&mut m, g).map(|out| assert_eq!(out, honest, "rank {rank}: OK with other data"));
        let next = step(&mut m, g).expect_err("the group is unusable");
        (got, next.status())
    })
}

fn assert_every_rank_fails(world: usize, liar: usize, lie: Lie, at: usize) {
    let case = format!("world {world}, {lie:?} at all_to_allv #{at}");
    // The liar's exchange: the routing (3), the rows there (4), the rows back (5). Op numbers:
    // the first step's dispatch makes ops 1-4 (header, routing, rows, verdict), its combine
    // 5-7 (header, rows, verdict); the second's dispatch starts at 8.
    let (call, op) = match at {
        3 => ("dispatch", 9),
        4 => ("dispatch", 10),
        _ => ("combine", 13),
    };
    for (r, (got, next)) in outcomes(world, liar, lie, at).into_iter().enumerate() {
        let e = got.expect_err(&format!("{case}: rank {r} returned OK"));
        assert_eq!(e.status(), Status::Runtime, "{case}: rank {r}: {e}");
        let msg = e.to_string();
        if r == liar {
            let says = match lie {
                Lie::Fails => format!("host transport all_to_allv failed during {call} of group 'host' on rank {r}: connection reset by the test"),
                Lie::Garbage => format!("host transport all_to_allv (rank 0's chunk) delivered a bad message during {call} of group 'host' on rank {r}: "),
            };
            assert!(msg.contains(&says), "{case}: rank {r}: {msg}");
        } else {
            assert_eq!(
                msg,
                format!("{call}: rank {liar} of group 'host' failed op #{op} (runtime error; see rank {liar}'s error), so it fails on every rank (rank {r} too); the group is unusable"),
                "{case}: rank {r}"
            );
        }
        assert_eq!(next, Status::InvalidState, "{case}: rank {r}");
    }
}

#[test]
fn a_failed_exchange_inside_a_call_fails_it_on_every_rank() {
    for world in [2, 3] {
        for at in [3, 4, 5] {
            assert_every_rank_fails(world, world - 1, Lie::Fails, at);
        }
    }
}

#[test]
fn garbage_inside_a_call_fails_it_on_every_rank() {
    for world in [2, 4] {
        for at in [3, 4, 5] {
            assert_every_rank_fails(world, 0, Lie::Garbage, at);
        }
    }
}

/// The honest transport gives every rank OK and the same sums as the first step (the
/// assertion inside `outcomes`), the control of the cases above.
#[test]
fn an_honest_transport_passes() {
    let transports = channel_transports_with(3, true, true);
    let n = transports.len();
    let out = on_transports(transports, move |rank, g: &mut HostGroup| {
        let cfg = MoeConfig {
            num_experts: 2 * n,
            top_k: K,
            hidden: HIDDEN,
            hidden_dtype: FloatKind::F32.dtype(),
            expert_dtype: FloatKind::F32,
            out_dtype: FloatKind::F32,
            max_tokens_per_rank: TOKENS,
            extra_row_bytes: vec![],
            apply_router_weight_on_input: false,
        };
        let mut m = Manager::new("deepep_high_throughput", cfg, rank, n).unwrap();
        let x = vec![1.0f32; TOKENS * HIDDEN];
        let ids: Vec<i64> = (0..TOKENS * K).map(|i| (i % (2 * n)) as i64).collect();
        let w = vec![0.5f32; TOKENS * K];
        let d = m.dispatch(g, epcomm::bytes::as_bytes(&x), &ids, &w, &[])?;
        let y = epcomm::bytes::to_vec::<f32>(d.hidden);
        let mut out = vec![0u8; TOKENS * HIDDEN * 4];
        m.combine(g, epcomm::bytes::as_bytes(&y), &mut out)?;
        epcomm::Result::Ok(epcomm::bytes::to_vec::<f32>(&out))
    });
    for (r, o) in out.into_iter().enumerate() {
        let o = o.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert!(o.iter().all(|&v| v == 1.0), "rank {r}: {:?}", &o[..8]);
    }
}
