//! "Did you mean" suggestions for mistyped names (hints only, never in messages).

/// Levenshtein edit distance over chars.
pub fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    let mut cur = vec![0; b.len() + 1];
    for (i, ca) in a.chars().enumerate() {
        cur[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != *cb);
            cur[j + 1] = sub.min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        std::mem::swap(&mut prev, &mut cur);
    }
    prev[b.len()]
}

/// Candidates closest to `given`, best first: case-insensitive matches and names that contain
/// the input (or are contained in it) rank before plain edit distance.
pub fn closest<'a>(given: &str, candidates: impl IntoIterator<Item = &'a str>) -> Vec<&'a str> {
    // Common shorthands people type for vLLM's names.
    let norm = |s: &str| {
        let s = s.to_ascii_lowercase().replace(['-', ' '], "_");
        s.split('_')
            .map(|part| match part {
                "2s" => "two_sided",
                "1s" => "one_sided",
                "ht" => "high_throughput",
                "ll" => "low_latency",
                "ar" | "agrs" => "allgather_reducescatter",
                p => p,
            })
            .collect::<Vec<_>>()
            .join("_")
    };
    let g = norm(given);
    let mut scored: Vec<(usize, &'a str)> = candidates
        .into_iter()
        .filter_map(|c| {
            let n = norm(c);
            let score = if n == g {
                0
            } else if !g.is_empty() && (n.contains(&g) || g.contains(&n)) {
                1
            } else {
                let d = edit_distance(&g, &n);
                // Too far to be a typo: more than a third of the longer name changed.
                if d * 3 > g.len().max(n.len()) {
                    return None;
                }
                2 + d
            };
            Some((score, c))
        })
        .collect();
    scored.sort_by_key(|(s, _)| *s);
    let best = scored.first().map(|(s, _)| *s);
    scored
        .into_iter()
        .filter(|(s, _)| Some(*s) == best || *s <= 3)
        .map(|(_, c)| c)
        .take(3)
        .collect()
}

/// A one-line hint: "did you mean 'x'?" (or 'x' or 'y'), else the full list of valid names.
pub fn did_you_mean<'a>(
    given: &str,
    candidates: impl IntoIterator<Item = &'a str> + Clone,
    what: &str,
) -> String {
    let best = closest(given, candidates.clone());
    if best.is_empty() {
        let all: Vec<String> = candidates.into_iter().map(|c| format!("'{c}'")).collect();
        format!("{what}: {}", all.join(", "))
    } else {
        let quoted: Vec<String> = best.iter().map(|c| format!("'{c}'")).collect();
        format!("did you mean {}?", quoted.join(" or "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distance() {
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(edit_distance("abc", "abc"), 0);
    }

    #[test]
    fn suggestions() {
        let names = [
            "flashinfer_nvlink_two_sided",
            "flashinfer_nvlink_one_sided",
            "naive",
        ];
        assert_eq!(closest("Naive", names), vec!["naive"]);
        assert_eq!(
            closest("flashinfer-nvlink-two-sided", names),
            vec!["flashinfer_nvlink_two_sided"]
        );
        assert!(closest("zzzzzzzz", names).is_empty());
        assert_eq!(
            did_you_mean("zzz", ["a", "b"], "valid names"),
            "valid names: 'a', 'b'"
        );
    }
}
