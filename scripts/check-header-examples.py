#!/usr/bin/env python3
"""The code examples in the public headers' comments and README.md compile: each must be a
copy of one `// clang-format off` ... `// clang-format on` region of
tests/docs/header_examples.cpp (compiled into dtrain_tests), compared line by line without
the leading `//`, indentation, blank lines and #include lines (the file includes those at
its top, and this checks it does).

In a header an example sits in its own `// clang-format off` ... `// clang-format on` region
of comment lines, so that the formatter cannot reflow it into prose. An indented comment
line outside such a region that looks like code (ends in ; { or }, with a call, an
assignment, -> or ::) is an unmarked example, and an error.

Usage: check-header-examples.py [ROOT] (default: this checkout). Exit 0 when every example
is compiled, 1 with one line per problem otherwise. tests/scripts/header_examples_test.sh
runs it in CTest, also on planted problems.
"""
import os
import re
import sys

EXAMPLES_CPP = "tests/docs/header_examples.cpp"

# Headers whose examples need not be marked yet, with the reason. Their code-like comment
# blocks are found by the heuristic below and must be compiled all the same.
UNMARKED_ALLOWED = {}
# Examples that do not compile as written, by header and first line, with the reason. An
# entry that no longer matches an example is an error, so that it goes once fixed.
NOT_COMPILED = {}

OFF, ON = "// clang-format off", "// clang-format on"


def normalize(lines):
    """Example lines without comment markers, indentation, blank and #include lines; and
    the #include lines apart."""
    code, includes = [], []
    for text in lines:
        text = text.strip()
        if not text:
            continue
        (includes if re.match(r"#\s*include\b", text) else code).append(text)
    return code, includes


def uncomment(line):
    text = line.strip()
    return text[2:] if text.startswith("//") else None


def code_like(text):
    """An example's line, rather than prose: `text` is a comment's text after `//`."""
    if not re.match(r"   ", text):  # examples are indented by 2 or more past the prose
        return False
    t = re.sub(r"\s+//.*$", "", text.strip())  # its own trailing comment
    if not re.search(r"[;{}]$", t):
        return False
    return bool(re.search(r"\w\(|\w\[|\S = |->|::|^[{}]", t))


def regions(lines):
    """(first line number, lines) of each clang-format off region."""
    out, start, body = [], None, []
    for n, line in enumerate(lines, 1):
        s = line.strip()
        if s == OFF:
            start, body = n + 1, []
        elif s == ON and start is not None:
            out.append((start, body))
            start = None
        elif start is not None:
            body.append(line)
    return out


def header_examples(root, rel, problems):
    """(line, code lines, include lines) of each example of one header."""
    with open(os.path.join(root, rel), encoding="utf-8") as f:
        lines = f.read().splitlines()
    found, marked = [], set()
    for start, body in regions(lines):
        marked.update(range(start - 1, start + len(body) + 1))
        texts = [uncomment(line) for line in body]
        if any(t is None for t in texts):
            continue  # code the formatter leaves alone, not an example
        code, includes = normalize(texts)
        if code:
            found.append((start, code, includes))
    # Unmarked: runs of indented comment lines holding at least one code-like line.
    run = []
    for n, line in enumerate(lines + [""], 1):
        text = uncomment(line)
        if n not in marked and text is not None and re.match(r"   ", text):
            run.append((n, text))
            continue
        if run and any(code_like(t) for _, t in run):
            if rel not in UNMARKED_ALLOWED:
                problems.append(f"{rel}:{run[0][0]}: an example outside `{OFF}` / `{ON}` "
                                "(the formatter may reflow it): mark it, and copy it into "
                                f"{EXAMPLES_CPP}")
            code, includes = normalize(t for _, t in run)
            found.append((run[0][0], code, includes))
        run = []
    return found


def readme_examples(root, problems):
    path = os.path.join(root, "README.md")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    found = []
    for m in re.finditer(r"^```cpp\n(.*?)^```", text, re.S | re.M):
        block = m.group(1)
        line = text.count("\n", 0, m.start()) + 2
        # The complete program (comment lines, then #include <dtrain/dtrain.h>): the package
        # test builds it against the installed dtrain and runs it on two ranks
        # (tests/package/run_consumer_test.cmake, package.find_package_consumer).
        if re.match(r"(//[^\n]*\n)+#include <dtrain/dtrain.h>", block):
            continue
        code, includes = normalize(block.splitlines())
        found.append((line, code, includes))
    return found


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else
                           os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    problems = []
    with open(os.path.join(root, EXAMPLES_CPP), encoding="utf-8") as f:
        cpp_lines = f.read().splitlines()
    compiled = [normalize(body)[0] for _, body in regions(cpp_lines)]
    cpp_includes = set(normalize(cpp_lines)[1])

    examples = []
    include_dir = os.path.join(root, "include", "dtrain")
    for dirpath, _, files in os.walk(include_dir):
        for name in sorted(files):
            if name.endswith(".h"):
                rel = os.path.relpath(os.path.join(dirpath, name), root)
                examples += [(rel, *e) for e in header_examples(root, rel, problems)]
    examples += [("README.md", *e) for e in readme_examples(root, problems)]

    used_exemptions = set()
    for rel, line, code, includes in sorted(examples):
        key = (rel, code[0])
        if key in NOT_COMPILED:
            used_exemptions.add(key)
            continue
        if code not in compiled:
            problems.append(f"{rel}:{line}: this example is not compiled: no `{OFF}` region of "
                            f"{EXAMPLES_CPP} holds it line for line (first line: {code[0]})")
        for inc in includes:
            if inc not in cpp_includes:
                problems.append(f"{rel}:{line}: {EXAMPLES_CPP} lacks the example's `{inc}`")
    for key in sorted(set(NOT_COMPILED) - used_exemptions):
        problems.append(f"{key[0]}: NOT_COMPILED in {os.path.basename(__file__)} names an "
                        f"example that no longer exists (first line: {key[1]}): remove it")

    for p in problems:
        print(f"check-header-examples: {p}", file=sys.stderr)
    if problems:
        print(f"check-header-examples: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    print(f"check-header-examples: {len(examples) - len(used_exemptions)} of {len(examples)} "
          f"examples compiled in {EXAMPLES_CPP}, {len(used_exemptions)} listed as not compilable "
          "as written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
