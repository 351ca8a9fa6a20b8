#!/usr/bin/env python3
"""Architecture figures for src/: lines, long functions, unwrap/expect, wildcard arms, unsafe.

Usage: scripts/arch-metrics.py [--long N] [--list]
Counts are textual (no Rust parser): a function runs from its `fn` line to the line where its
braces balance; comments and string literals are skipped for brace counting. Test modules
(`#[cfg(test)] mod ...`) are left out of the unwrap/expect count.
"""
import re
import subprocess
import sys

FN = re.compile(r'^\s*(pub(\([^)]*\))?\s+)?(const\s+)?(async\s+)?(unsafe\s+)?(extern\s+"C"\s+)?fn\s+(\w+)')


def strip(line):
    """The line without string/char literals and // comments (good enough for braces)."""
    line = re.sub(r'"(\\.|[^"\\])*"', '""', line)
    line = re.sub(r"'(\\.|[^'\\])'", "''", line)
    return line.split('//', 1)[0]


def functions(path, lines):
    out = []
    i = 0
    while i < len(lines):
        m = FN.match(lines[i])
        if not m:
            i += 1
            continue
        depth, opened, j = 0, False, i
        while j < len(lines):
            s = strip(lines[j])
            if not opened and ';' in s and '{' not in s:
                break  # a declaration without a body
            depth += s.count('{') - s.count('}')
            opened = opened or '{' in s
            if opened and depth <= 0:
                out.append((j - i + 1, path, i + 1, m.group(7)))
                break
            j += 1
        i += 1
    return out


def test_ranges(lines):
    """Line numbers inside `#[cfg(test)]` modules."""
    inside, depth, skip = False, 0, set()
    for n, line in enumerate(lines):
        if not inside and line.strip() == '#[cfg(test)]' and n + 1 < len(lines) and 'mod ' in lines[n + 1]:
            inside, depth = True, 0
        if inside:
            skip.add(n)
            s = strip(line)
            depth += s.count('{') - s.count('}')
            if depth <= 0 and '}' in s:
                inside = False
    return skip


def main():
    long_at = 80
    if '--long' in sys.argv:
        long_at = int(sys.argv[sys.argv.index('--long') + 1])
    files = subprocess.run(['git', 'ls-files', 'src'], capture_output=True, text=True,
                           check=True).stdout.split()
    rs = [f for f in files if f.endswith('.rs')]
    total, fns, unwraps, wild, unsafe_blocks, no_safety = 0, [], 0, 0, 0, []
    for f in rs:
        lines = open(f, encoding='utf-8').read().split('\n')
        total += len(lines)
        fns += functions(f, lines)
        skip = test_ranges(lines)
        for n, line in enumerate(lines):
            if n in skip:
                continue
            s = strip(line)
            unwraps += len(re.findall(r'\.(unwrap|expect)\(', s))
            wild += len(re.findall(r'^\s*_\s*=>', s))
            if re.search(r'\bunsafe\s*\{', s):
                unsafe_blocks += 1
                above = '\n'.join(lines[max(0, n - 6):n + 1])
                if 'SAFETY' not in above:
                    no_safety.append(f'{f}:{n + 1}')
    long = sorted([x for x in fns if x[0] > long_at], reverse=True)
    print(f'src .rs files          {len(rs)}')
    print(f'src .rs lines          {total}')
    print(f'functions              {len(fns)}')
    print(f'functions > {long_at} lines  {len(long)}')
    print(f'unwrap/expect (no test mods) {unwraps}')
    print(f'wildcard `_ =>` arms   {wild}')
    print(f'unsafe blocks          {unsafe_blocks} ({len(no_safety)} without SAFETY within 6 lines)')
    if '--list' in sys.argv:
        for n, f, line, name in long:
            print(f'  {n:5d}  {f}:{line} {name}')
        for s in no_safety:
            print(f'  no SAFETY: {s}')


main()
