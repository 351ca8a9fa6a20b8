//! The frame of each message of the host-callback transport: a header (op, step, op number,
//! sender, receiver, message number, length) before the payload and a tail word after it. A
//! receiver checks every field against what it expects, so a host transport that delivers
//! wrong bytes (garbled, short, from another peer, of another op, an all_gather slot it left
//! unwritten) is an error instead of wrong data. Payloads are not checksummed: bytes garbled
//! inside a payload whose frame is intact go unnoticed.

use super::Op;

/// Bytes before the payload: five words.
pub const HEAD: usize = 5 * 8;
/// Bytes after the payload: one word.
pub const TAIL: usize = 8;
/// The receiver of an all_gather part: every rank.
pub const TO_ALL: u64 = u32::MAX as u64;
/// High bits of word 0 ("epmg"): a frame from anything else is a broken host transport.
const TAG: u64 = 0x6570_6d67 << 32;

/// Which step of an op a message belongs to. Declaration order, from 1, is the wire code
/// (pinned code by code in this file's tests): only append.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// The op header every rank gathers first (its verdict on its arguments, the op).
    Header = 1,
    /// Agreement data: size lists, message lists.
    Agreement,
    /// The op's data.
    Data,
    /// The verdict every rank gathers last (how its op went).
    Verdict,
}

impl Step {
    const ALL: [Step; 4] = [Step::Header, Step::Agreement, Step::Data, Step::Verdict];

    fn name(self) -> &'static str {
        match self {
            Step::Header => "header",
            Step::Agreement => "agreement",
            Step::Data => "data",
            Step::Verdict => "verdict",
        }
    }

    fn from_code(c: u64) -> Option<Step> {
        Step::ALL.into_iter().find(|s| *s as u64 == c)
    }
}

/// Which message word 0 of a frame names: "an op header message", "broadcast's data message".
fn describe(w0: u64) -> String {
    let step = Step::from_code(w0 & 0xff);
    if step == Some(Step::Header) {
        return "an op header message".into();
    }
    let op = u32::try_from(w0 >> 8 & 0xff)
        .ok()
        .and_then(Op::from_code)
        .map_or("an unknown op", Op::name);
    let step = step.map_or("unknown step", Step::name);
    format!("{op}'s {step} message")
}

/// What one message must carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Frame {
    pub op: Op,
    pub step: Step,
    /// The op number (every rank counts its ops alike).
    pub seq: u64,
    pub from: usize,
    /// A rank, or [`TO_ALL`].
    pub to: u64,
    /// The number of this message among those from `from` to `to` in this op.
    pub index: u64,
    /// Payload bytes.
    pub len: usize,
}

impl Frame {
    fn head(&self) -> [u64; 5] {
        // An op header names no op in its frame: ranks that call different collectives are
        // found by the headers themselves, with their own message.
        let op = match self.step {
            Step::Header => 0,
            Step::Agreement | Step::Data | Step::Verdict => self.op as u64,
        };
        [
            TAG | op << 8 | self.step as u64,
            self.seq,
            self.from as u64,
            self.to << 32 | self.index,
            self.len as u64,
        ]
    }

    /// The tail word: depends on the op number and length, so a tail left from an earlier
    /// message or never written does not pass.
    fn tail(&self) -> u64 {
        TAG ^ self.seq.rotate_left(20) ^ self.len as u64
    }

    /// The framed message: bytes of `HEAD + len + TAIL`.
    pub fn size(&self) -> usize {
        HEAD + self.len + TAIL
    }

    /// `payload` framed, into `buf` (resized).
    pub fn wrap(&self, payload: &[u8], buf: &mut Vec<u8>) {
        debug_assert_eq!(payload.len(), self.len);
        buf.resize(self.size(), 0);
        buf[HEAD..HEAD + self.len].copy_from_slice(payload);
        self.seal(buf);
    }

    /// Writes the header and tail around the payload already in place in `buf` (`size()`
    /// bytes): callers that pack straight into a frame save a copy.
    pub fn seal(&self, buf: &mut [u8]) {
        debug_assert_eq!(buf.len(), self.size());
        for (i, w) in self.head().into_iter().enumerate() {
            buf[i * 8..i * 8 + 8].copy_from_slice(&w.to_le_bytes());
        }
        let end = buf.len();
        buf[end - TAIL..].copy_from_slice(&self.tail().to_le_bytes());
    }

    /// Prepares `buf` (`size()` bytes) to receive this frame: a header and tail the host does
    /// not write never pass [`Frame::check`].
    pub fn blank(&self, buf: &mut [u8]) {
        buf[..HEAD].fill(0);
        let end = buf.len();
        buf[end - TAIL..].copy_from_slice(&(!self.tail()).to_le_bytes());
    }

    /// The payload of `buf` when it carries this frame, else what is wrong with it.
    pub fn check<'a>(&self, buf: &'a [u8]) -> Result<&'a [u8], String> {
        if buf.len() != self.size() {
            return Err(format!(
                "it has {} bytes; expected {}",
                buf.len(),
                self.size()
            ));
        }
        let word =
            |i: usize| u64::from_le_bytes(buf[i * 8..i * 8 + 8].try_into().unwrap_or([0; 8]));
        let want = self.head();
        if word(0) & !0xffff != TAG {
            return Err(
                "it is not an epcomm message (the bytes are garbled, or were never written)".into(),
            );
        }
        let tail = &buf[HEAD + self.len..];
        if tail == (!self.tail()).to_le_bytes() {
            // Still as [`Frame::blank`] left it: the host wrote the start only.
            return Err("its end was never written (a short receive)".into());
        }
        if word(0) != want[0] {
            return Err(format!(
                "it is {}; expected {}",
                describe(word(0)),
                describe(want[0])
            ));
        }
        if word(1) != self.seq {
            return Err(format!(
                "it belongs to op #{} of this group; expected op #{}",
                word(1),
                self.seq
            ));
        }
        if word(2) != want[2] {
            return Err(format!(
                "it was sent by rank {}; expected rank {}",
                word(2),
                self.from
            ));
        }
        if word(3) != want[3] {
            let to = |w: u64| match w >> 32 {
                TO_ALL => "every rank".to_owned(),
                r => format!("rank {r}"),
            };
            return Err(format!(
                "it is message #{} to {}; expected message #{} to {}",
                word(3) & 0xffff_ffff,
                to(word(3)),
                self.index,
                to(want[3])
            ));
        }
        if word(4) != want[4] {
            return Err(format!(
                "it carries {} bytes; expected {}",
                word(4),
                self.len
            ));
        }
        if tail != self.tail().to_le_bytes() {
            return Err("its end is garbled".into());
        }
        Ok(&buf[HEAD..HEAD + self.len])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `all` is `pins`' variants, each with its wire code both ways.
    fn pinned<T: Copy + PartialEq + std::fmt::Debug>(
        all: &[T],
        pins: &[(T, u64)],
        code: fn(T) -> u64,
        from_code: fn(u64) -> Option<T>,
    ) {
        assert_eq!(all, pins.iter().map(|p| p.0).collect::<Vec<T>>());
        for &(v, c) in pins {
            assert_eq!((code(v), from_code(c)), (c, Some(v)), "{v:?}");
        }
        assert_eq!(from_code(0), None);
    }

    #[test]
    fn wire_codes_are_pinned() {
        let ops = [
            (Op::Join, 1),
            (Op::Barrier, 2),
            (Op::AllGatherv, 3),
            (Op::ReduceScatterv, 4),
            (Op::AllToAllv, 5),
            (Op::SendRecv, 6),
            (Op::Broadcast, 7),
            (Op::Leave, 8),
            (Op::ExchangeRows, 9),
            (Op::ReduceRows, 10),
        ];
        let op_of = |c: u64| u32::try_from(c).ok().and_then(Op::from_code);
        pinned(&Op::ALL, &ops, |op| op as u64, op_of);
        let steps = [
            (Step::Header, 1),
            (Step::Agreement, 2),
            (Step::Data, 3),
            (Step::Verdict, 4),
        ];
        pinned(&Step::ALL, &steps, |step| step as u64, Step::from_code);
    }

    fn frame() -> Frame {
        Frame {
            op: Op::Broadcast,
            step: Step::Data,
            seq: 7,
            from: 1,
            to: 2,
            index: 0,
            len: 64,
        }
    }

    #[test]
    fn a_frame_passes_only_whole_and_as_expected() {
        let f = frame();
        let payload = [7u8; 64];
        let mut buf = Vec::new();
        f.wrap(&payload, &mut buf);
        assert_eq!(f.check(&buf).unwrap(), payload);
        let mut blank = vec![0xAA; f.size()];
        f.blank(&mut blank);
        assert_eq!(
            f.check(&blank).unwrap_err(),
            "it is not an epcomm message (the bytes are garbled, or were never written)"
        );
        // The first half written (a short receive).
        blank[..f.size() / 2].copy_from_slice(&buf[..f.size() / 2]);
        assert_eq!(
            f.check(&blank).unwrap_err(),
            "its end was never written (a short receive)"
        );
        // A short receive that wrote less than the header is one too.
        let mut blank = vec![0xAA; f.size()];
        f.blank(&mut blank);
        blank[..12].copy_from_slice(&buf[..12]);
        assert_eq!(
            f.check(&blank).unwrap_err(),
            "its end was never written (a short receive)"
        );
        let mut garbled = buf.clone();
        let end = garbled.len() - 1;
        garbled[end] ^= 1;
        assert_eq!(f.check(&garbled).unwrap_err(), "its end is garbled");
        let other = |g: Frame| {
            let mut b = Vec::new();
            g.wrap(&payload, &mut b);
            f.check(&b).unwrap_err()
        };
        assert_eq!(
            other(Frame { seq: 6, ..f }),
            "it belongs to op #6 of this group; expected op #7"
        );
        assert_eq!(
            other(Frame { from: 0, ..f }),
            "it was sent by rank 0; expected rank 1"
        );
        assert_eq!(
            other(Frame { index: 1, ..f }),
            "it is message #1 to rank 2; expected message #0 to rank 2"
        );
        assert_eq!(
            other(Frame {
                op: Op::Barrier,
                step: Step::Verdict,
                ..f
            }),
            "it is barrier's verdict message; expected broadcast's data message"
        );
        assert_eq!(
            other(Frame {
                step: Step::Header,
                ..f
            }),
            "it is an op header message; expected broadcast's data message"
        );
    }
}
