//! The examples of the headers and the API guide compile and run: every ```cpp block of
//! include/epcomm.hpp (in its `//` comments) and of docs/api.md whose first line is
//! `#include "epcomm.hpp"` is a complete example that defines
//! `std::vector<float> moe_step(const std::string &group, int rank)`. Each is extracted
//! verbatim, built as C++17 with -Wall -Wextra -Werror under ASan+UBSan with a harness that
//! forks ranks 0 and 1 (a 60 s deadline), and must return on each rank its own input, every
//! element rank + 1 (its toy experts are the identity and each token's weights sum to 1). So a
//! header or guide example that no longer compiles, throws or computes something else fails
//! here.

mod common;

use std::time::Duration;

use common::*;

/// The first line of every example block.
const INCLUDE: &str = "#include \"epcomm.hpp\"";

/// The harness appended to each example: two forked ranks, each checking its result.
const HARNESS: &str = r#"
#include <cstdio>
#include <exception>
#include <string>
#include <vector>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

static int run_rank(const std::string &group, int rank) {
    try {
        const std::vector<float> out = moe_step(group, rank);
        if (out.empty()) {
            std::printf("rank %d: moe_step returned nothing\n", rank);
            return 1;
        }
        for (size_t i = 0; i < out.size(); ++i) {
            if (out[i] != float(rank + 1)) {
                std::printf("rank %d: element %zu is %g; expected %d\n", rank, i, double(out[i]), rank + 1);
                return 1;
            }
        }
        std::printf("rank %d: %zu elements, each %d\n", rank, out.size(), rank + 1);
        return 0;
    } catch (const std::exception &e) {
        std::printf("rank %d threw: %s\n", rank, e.what());
        return 1;
    }
}

int main(int argc, char **argv) {
    if (argc < 2) return 2;
    std::fflush(stdout);
    pid_t pids[2];
    for (int rank = 0; rank < 2; ++rank) {
        pids[rank] = fork();
        if (pids[rank] == 0) {
            alarm(60);
            const int rc = run_rank(argv[1], rank);
            std::fflush(stdout);
            _exit(rc);
        }
    }
    int passed = 0, failed = 0;
    for (int rank = 0; rank < 2; ++rank) {
        int status = 0;
        waitpid(pids[rank], &status, 0);
        if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
            ++passed;
        } else {
            ++failed;
            std::printf("rank %d failed (status %d)\n", rank, status);
        }
    }
    std::printf("%d passed, %d failed\n", passed, failed);
    return failed == 0 ? 0 : 1;
}
"#;

/// The example blocks of `text`: ```cpp fences whose first line is INCLUDE, with `prefix`
/// (the comment marker of a header, "" for Markdown) taken off every line.
fn examples(text: &str, prefix: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut block: Option<Vec<String>> = None;
    for line in text.lines() {
        let Some(body) = line.trim_start().strip_prefix(prefix) else {
            block = None;
            continue;
        };
        let body = body.strip_prefix(' ').unwrap_or(body);
        match block.as_mut() {
            None if body.trim() == "```cpp" => block = Some(Vec::new()),
            None => {}
            Some(lines) if body.trim() == "```" => {
                if lines.first().map(|l| l.trim()) == Some(INCLUDE) {
                    out.push(lines.join("\n"));
                }
                block = None;
            }
            Some(lines) => lines.push(body.to_owned()),
        }
    }
    out
}

fn check_examples(file: &str, prefix: &str, tag: &str) {
    let text = std::fs::read_to_string(manifest_dir().join(file)).expect("read the file");
    let found = examples(&text, prefix);
    assert!(
        !found.is_empty(),
        "{file} has no ```cpp example starting with {INCLUDE}"
    );
    for (i, code) in found.iter().enumerate() {
        let dir = out_dir(&format!("header-example-{tag}-{i}"));
        let source = dir.join("example.cpp");
        std::fs::write(&source, format!("{code}\n{HARNESS}")).expect("write the example");
        let exe = dir.join("example");
        build_sanitized(&cxx_compiler(), Lang::Cxx17.flags(), &source, &exe);
        let out = run_group_program(
            &exe,
            &group_name(&format!("hdrex{tag}"), &i.to_string()),
            Duration::from_secs(90),
        );
        assert_c_test_passed(&format!("example {i} of {file} (two ranks)"), &out);
        assert!(
            out.stdout.contains("rank 0: ") && out.stdout.contains("rank 1: "),
            "{}",
            out.describe("both ranks report")
        );
    }
}

#[test]
fn epcomm_hpp_examples_compile_and_run() {
    check_examples("include/epcomm.hpp", "//", "hpp");
}

#[test]
fn api_md_examples_compile_and_run() {
    check_examples("docs/api.md", "", "api");
}

#[test]
fn example_blocks_are_found_verbatim() {
    let text =
        "// ```cpp\n// #include \"epcomm.hpp\"\n// int a;\n// ```\n// ```cpp\n// int b;\n// ```\n";
    assert_eq!(
        examples(text, "//"),
        vec!["#include \"epcomm.hpp\"\nint a;".to_owned()]
    );
}
