//! The fault/tamper campaign's plumbing (tests/fault_campaign.rs, scripts/fault-campaign.sh): the
//! classes, a seeded generator for the random moments, what a rank reports, the rules every run
//! is checked against, and the summary table.
#![allow(dead_code)]

pub mod workload;

use std::fmt::Write as _;
use std::time::Duration;

/// What a class of runs exercises.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Class {
    /// Dispatch/combine steps; one rank is signalled.
    Moe,
    /// EPLB rearrangement rounds; one rank is signalled.
    Eplb,
    /// barrier, all_gatherv, reduce_scatterv and broadcast steps; one rank is signalled.
    Collectives,
    /// Two jobs of two ranks start at once with one group name.
    SameName,
    /// The parent overwrites or truncates the group's /dev/shm segments during the run.
    Tamper,
}

impl Class {
    pub const ALL: [Class; 5] = [
        Class::Moe,
        Class::Eplb,
        Class::Collectives,
        Class::SameName,
        Class::Tamper,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Class::Moe => "moe",
            Class::Eplb => "eplb",
            Class::Collectives => "collectives",
            Class::SameName => "same_name",
            Class::Tamper => "tamper",
        }
    }

    pub fn parse(s: &str) -> Option<Class> {
        Class::ALL.into_iter().find(|c| c.name() == s)
    }

    /// Whether one rank of the run gets a signal.
    pub fn signals(self) -> bool {
        match self {
            Class::Moe | Class::Eplb | Class::Collectives => true,
            Class::SameName | Class::Tamper => false,
        }
    }
}

/// The signal a faulty rank gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    Kill,
    /// SIGSTOP, then SIGCONT after more than the timeout.
    Stop,
    Term,
    Int,
}

impl Fault {
    pub const ALL: [Fault; 4] = [Fault::Kill, Fault::Stop, Fault::Term, Fault::Int];

    pub fn signal(self) -> i32 {
        match self {
            Fault::Kill => libc::SIGKILL,
            Fault::Stop => libc::SIGSTOP,
            Fault::Term => libc::SIGTERM,
            Fault::Int => libc::SIGINT,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Fault::Kill => "KILL",
            Fault::Stop => "STOP",
            Fault::Term => "TERM",
            Fault::Int => "INT",
        }
    }
}

/// splitmix64: the campaign's random moments, reproducible from a seed.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// What one rank printed: `FC_RESULT ok|err <status> <steps done> <wrong> <message>`, and for
/// EPLB `FC_EPLB <round> <layers done in that round>`, for same-name runs `FC_JOBS <ids>`.
#[derive(Clone, Debug, Default)]
pub struct Report {
    pub ok: bool,
    pub status: i32,
    pub steps: u64,
    /// Results that differed from the reference after an OK call.
    pub wrong: u64,
    pub message: String,
    /// (round, layers of that round rearranged) for EPLB.
    pub eplb: Option<(u64, u64)>,
    /// The job ids of the group's members as this rank saw them (same-name runs).
    pub jobs: Option<Vec<u64>>,
}

pub const RESULT: &str = "FC_RESULT ";
pub const EPLB: &str = "FC_EPLB ";
pub const JOBS: &str = "FC_JOBS ";

impl Report {
    pub fn parse(stdout: &str) -> Option<Report> {
        let line = stdout.lines().find_map(|l| l.strip_prefix(RESULT))?;
        let p: Vec<&str> = line.splitn(5, ' ').collect();
        if p.len() != 5 {
            return None;
        }
        let eplb = stdout
            .lines()
            .find_map(|l| l.strip_prefix(EPLB))
            .and_then(|l| {
                let mut it = l.split(' ').map(|x| x.parse::<u64>().ok());
                Some((it.next()??, it.next()??))
            });
        let jobs = stdout
            .lines()
            .find_map(|l| l.strip_prefix(JOBS))
            .map(|l| l.split(' ').filter_map(|x| x.parse().ok()).collect());
        Some(Report {
            ok: p[0] == "ok",
            status: p[1].parse().ok()?,
            steps: p[2].parse().ok()?,
            wrong: p[3].parse().ok()?,
            message: p[4].to_owned(),
            eplb,
            jobs,
        })
    }
}

/// The ranks an error message names ("rank R", "rank(s) R, S"), without the reporting rank's
/// own "seen from rank r" and without the ranks a join timeout lists as "joined: rank(s) ..."
/// (those arrived; the missing ones are named before them).
pub fn ranks_named(message: &str) -> Vec<usize> {
    let mut named = Vec::new();
    let mut rest = message;
    while let Some(i) = rest.find("rank") {
        let before = &rest[..i];
        rest = &rest[i + 4..];
        if before.ends_with("seen from ") || before.ends_with("joined: ") {
            continue;
        }
        let list = rest.strip_prefix("(s) ").or_else(|| rest.strip_prefix(' '));
        let Some(list) = list else { continue };
        // A list "1, 2" or a single number.
        for part in list.split(", ") {
            let digits: String = part.chars().take_while(|c| c.is_ascii_digit()).collect();
            match digits.parse() {
                Ok(r) => named.push(r),
                Err(_) => break,
            }
            if digits.len() != part.len() {
                break;
            }
        }
    }
    named.sort_unstable();
    named.dedup();
    named
}

/// A rule a run can break (a column of the table), or `Info` for a note that breaks none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rule {
    Crashes,
    Hangs,
    Leftovers,
    SilentWrong,
    Divergent,
    Misblamed,
    MixedGroups,
    Info,
}

impl Rule {
    pub const VIOLATIONS: [Rule; 7] = [
        Rule::Crashes,
        Rule::Hangs,
        Rule::Leftovers,
        Rule::SilentWrong,
        Rule::Divergent,
        Rule::Misblamed,
        Rule::MixedGroups,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Rule::Crashes => "crashes",
            Rule::Hangs => "hangs",
            Rule::Leftovers => "leftovers",
            Rule::SilentWrong => "silent_wrong",
            Rule::Divergent => "divergent",
            Rule::Misblamed => "misblamed",
            Rule::MixedGroups => "mixed_groups",
            Rule::Info => "info",
        }
    }
}

/// The counts the table shows for one class.
#[derive(Clone, Debug, Default)]
pub struct Tally {
    pub runs: u64,
    /// Runs whose fault hit the victim before it finished (signal classes), runs that found a
    /// segment to tamper with (tamper), runs whose two jobs overlapped (same name).
    pub hit: u64,
    /// A rank died of a signal nobody sent it, or exited without a result (a panic, an abort).
    pub crashes: u64,
    /// A rank still running at the deadline, or a survivor ending later than timeout + margin
    /// after the fault.
    pub hangs: u64,
    pub leftovers: u64,
    pub silent_wrong: u64,
    /// Ranks that reached different outcomes (one OK, another failed; other steps; other EPLB
    /// layers).
    pub divergent: u64,
    /// A survivor's error does not name the faulty rank, or names a healthy one.
    pub misblamed: u64,
    pub mixed_groups: u64,
    /// The longest a survivor took to end after the fault reached its peer (signal classes).
    pub slowest: Duration,
    /// What each violation was, for the failure message.
    pub notes: Vec<(Rule, String)>,
}

impl Tally {
    /// Runs that broke `rule`.
    pub fn count(&self, rule: Rule) -> u64 {
        match rule {
            Rule::Crashes => self.crashes,
            Rule::Hangs => self.hangs,
            Rule::Leftovers => self.leftovers,
            Rule::SilentWrong => self.silent_wrong,
            Rule::Divergent => self.divergent,
            Rule::Misblamed => self.misblamed,
            Rule::MixedGroups => self.mixed_groups,
            Rule::Info => 0,
        }
    }

    pub fn violations(&self) -> u64 {
        Rule::VIOLATIONS.iter().map(|&r| self.count(r)).sum()
    }

    pub fn note(&mut self, rule: Rule, text: String) {
        self.notes.push((rule, text));
    }

    pub fn add(&mut self, o: &Tally) {
        self.runs += o.runs;
        self.hit += o.hit;
        self.crashes += o.crashes;
        self.hangs += o.hangs;
        self.leftovers += o.leftovers;
        self.silent_wrong += o.silent_wrong;
        self.divergent += o.divergent;
        self.misblamed += o.misblamed;
        self.mixed_groups += o.mixed_groups;
        self.slowest = self.slowest.max(o.slowest);
        self.notes.extend(o.notes.iter().cloned());
    }
}

/// The summary table, one row per class and a total.
pub fn table(rows: &[(Class, Tally)]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<12} {:>5} {:>5} {:>7} {:>5} {:>9} {:>12} {:>9} {:>9} {:>12} {:>10}",
        "class",
        "runs",
        "hit",
        "crashes",
        "hangs",
        "leftovers",
        "silent_wrong",
        "divergent",
        "misblamed",
        "mixed_groups",
        "slowest_ms"
    );
    let mut total = Tally::default();
    let mut line = |name: &str, t: &Tally| {
        let _ = writeln!(
            s,
            "{:<12} {:>5} {:>5} {:>7} {:>5} {:>9} {:>12} {:>9} {:>9} {:>12} {:>10}",
            name,
            t.runs,
            t.hit,
            t.crashes,
            t.hangs,
            t.leftovers,
            t.silent_wrong,
            t.divergent,
            t.misblamed,
            t.mixed_groups,
            t.slowest.as_millis()
        );
    };
    for (c, t) in rows {
        line(c.name(), t);
        total.add(t);
    }
    line("total", &total);
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_named_reads_lists_and_skips_the_reporter() {
        assert_eq!(
            ranks_named(
                "rank 2 of group 'g' died (pid 7 is gone) during barrier (op #3, seen from rank 0)"
            ),
            vec![2]
        );
        assert_eq!(
            ranks_named(
                "timed out after 1.0 s in barrier of group 'g' (op #4) waiting for rank(s) 1, 2"
            ),
            vec![1, 2]
        );
        assert_eq!(
            ranks_named(
                "timed out after 1.0 s waiting for rank(s) 2 to join group 'g' (rank(s) 2 of 3 missing; joined: rank(s) 0, 1); check that those ranks were started"
            ),
            vec![2]
        );
        assert_eq!(ranks_named("group 'g' is unusable"), Vec::<usize>::new());
    }

    #[test]
    fn eplb_layers_done_reads_the_layer_report() {
        use super::workload::eplb_layers_done;
        assert_eq!(
            eplb_layers_done("x (EPLB rearrangement: no layer was changed)"),
            Some(0)
        );
        assert_eq!(
            eplb_layers_done(
                "x (EPLB rearrangement: layers before 2 were rearranged; layer 2 and later keep the old placement)"
            ),
            Some(2)
        );
        assert_eq!(
            eplb_layers_done("send_recv: rank 1 sent 2 message(s)"),
            None
        );
    }
}
