#!/usr/bin/env python3
"""The layering test: no folder of the product code includes one above it.

  check_layering.py [--root DIR] [--layers FILE] [--graph] [--self-test]

Reads the layers from tests/layering/layers.txt (the one place they are
written down), scans every #include "..." line of the product code (comm,
models, checkpoint, framework, tools, train.cpp, bench) and prints, for each
include that goes up or sideways, or into a folder the table does not name,
FILE:LINE and the two folders. Exits 1 when it found any, else 0.

It also checks what the includes cannot show: a folder naming what a layer
above it owns. layers.txt's [unnamed] section lists, per folder, the names
that must not appear there as string literals: the trainer's checkpoint
items (the k...Item constants of framework/config/run_items.h) and the
config keys (SHARDKIT_CONFIG_FIELD in framework/config/schema.cpp) but
those of checkpoint's own section. checkpoint/ knows nothing of the
trainer: its exports ask a checkpoint::RunAdapter.

--graph prints the folder-level graph the code has (what each folder
includes), in the table's order; docs/architecture.md draws the same graph.
--self-test first checks the checker on a scratch tree with one of each
problem (and a clean one). Registered as the CTest test
layering.NoFolderIncludesOneAboveIt (tests/layering/CMakeLists.txt).
"""
import argparse
import os
import re
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"')
LITERAL = re.compile(r'"((?:[^"\\\n]|\\.)*)"')
ITEM_CONSTANT = re.compile(r'constexpr\s+const\s+char\s*\*\s*k\w+Item\s*=\s*"([^"]+)"')
CONFIG_FIELD = re.compile(r'SHARDKIT_CONFIG_FIELD\(([\w.]+)\)')
SOURCES = ('.h', '.hpp', '.cpp', '.cc')


class Layers:
    """The table: top-level rules and, per folder, its parts bottom first."""

    def __init__(self, path):
        self.top = {}     # top-level name -> names it may include
        self.order = []   # top-level names, as listed
        self.parts = {}   # folder -> [[part, ...] per level], bottom first
        self.unnamed = []  # (folder, "items"|"keys", source file, excepted prefix)
        section = None
        with open(path) as f:
            for number, raw in enumerate(f, 1):
                line = raw.split('#', 1)[0].strip()
                if not line:
                    continue
                if line.startswith('['):
                    section = line.strip('[]')
                    if section not in ('top', 'unnamed'):
                        self.parts[section] = []
                    continue
                if section == 'unnamed':
                    folder, _, rest = line.partition(':')
                    words = rest.split()
                    self.unnamed.append((folder.strip(), words[0], words[1],
                                         words[2] if len(words) > 2 else None))
                    continue
                if section == 'top':
                    name, _, uses = line.partition(':')
                    self.top[name.strip()] = set(uses.split())
                    self.order.append(name.strip())
                elif section is not None:
                    self.parts[section].append(line.split())
                else:
                    sys.exit('%s:%d: a line before any [section]' % (path, number))

    def level(self, folder, part):
        for i, names in enumerate(self.parts[folder]):
            if part in names:
                return i
        return None


class Unit:
    """Where a file sits: its top-level folder and, for a folder with parts,
    its part ("storage", "errors.h", "*") and that part's level."""

    def __init__(self, top, part=None, level=None):
        self.top, self.part, self.level = top, part, level

    def label(self):
        return self.top if self.part is None else self.top + '/' + self.part

    def same(self, other):
        return self.top == other.top and self.part == other.part


def unit_of(layers, path):
    """The Unit of `path` (relative to the root), or a string saying why the
    table has no place for it."""
    parts = path.split('/')
    top = parts[0]
    if top not in layers.top:
        return None  # not product code (tests, examples, ...): not checked
    if top not in layers.parts or len(parts) == 1:
        return Unit(top)
    table = layers.parts[top]
    if len(parts) == 2:  # a file at the folder's root: by its stem
        stem = os.path.splitext(parts[1])[0]
        for names in table:
            for name in names:
                if '.' in name and os.path.splitext(name)[0] == stem:
                    return Unit(top, name, layers.level(top, name))
        level = layers.level(top, '(root)')
        if level is None:
            return '%s/%s is a root file of %s/ that %s does not name' % (
                top, parts[1], top, 'layers.txt')
        return Unit(top, '(root)', level)
    level = layers.level(top, parts[1])
    if level is None:
        return '%s/%s/ is a folder that layers.txt does not name' % (top, parts[1])
    return Unit(top, parts[1], level)


def source_files(root, layers):
    for top in layers.order:
        path = os.path.join(root, top)
        if os.path.isfile(path):
            yield top
            continue
        for directory, dirs, files in os.walk(path):
            dirs.sort()
            for name in sorted(files):
                if name.endswith(SOURCES):
                    yield os.path.relpath(os.path.join(directory, name), root)


def includes(root, path):
    """(line number, included path relative to the root) of each #include
    "..." of `path` that names a file of the tree (from the root, or next to
    the file); includes of anything else (third-party, generated) are not
    the table's business."""
    with open(os.path.join(root, path), errors='replace') as f:
        for number, line in enumerate(f, 1):
            m = INCLUDE.match(line)
            if not m:
                continue
            target = m.group(1)
            if os.path.isfile(os.path.join(root, target)):
                yield number, os.path.normpath(target)
            else:
                beside = os.path.join(os.path.dirname(path), target)
                if os.path.isfile(os.path.join(root, beside)):
                    yield number, os.path.normpath(beside)


def verdict(layers, a, b):
    """None when unit `a` may include unit `b`; else what is wrong."""
    if a.top != b.top:
        return None if b.top in layers.top[a.top] else 'which is not below it'
    if a.part is None or a.same(b):
        return None
    if b.level < a.level:
        return None
    return 'a layer above it' if b.level > a.level else 'a sibling on its layer'


def scan(root, layers):
    """(problems, edges): problems as printable lines; edges as
    {(from label, to label): allowed}."""
    problems, edges, unplaced = [], {}, set()
    for path in source_files(root, layers):
        a = unit_of(layers, path)
        if isinstance(a, str):
            if a not in unplaced:
                unplaced.add(a)
                problems.append('%s: %s (add it to tests/layering/layers.txt)' % (path, a))
            continue
        for number, target in includes(root, path):
            b = unit_of(layers, target)
            if b is None or isinstance(b, str):
                continue  # not product code, or reported as unplaced above
            if a.same(b):
                continue
            why = verdict(layers, a, b)
            edges[(a.label(), b.label())] = edges.get((a.label(), b.label()), True) and why is None
            if why is not None:
                problems.append('%s:%d: %s includes %s (%s), %s' % (
                    path, number, a.label(), b.label(), target, why))
    return problems, edges


def forbidden_names(root, layers):
    """{folder: {name: where it comes from}} from the [unnamed] rules."""
    out = {}
    for folder, kind, source, excepted in layers.unnamed:
        path = os.path.join(root, source)
        if not os.path.isfile(path):
            continue  # a scratch tree without it
        with open(path, errors='replace') as f:
            text = f.read()
        pattern = ITEM_CONSTANT if kind == 'items' else CONFIG_FIELD
        for name in pattern.findall(text):
            if excepted and name.startswith(excepted):
                continue
            out.setdefault(folder, {})[name] = source
    return out


def code_literals(line):
    """The string literals of a line of C++, not those in a // comment."""
    out = []
    at = 0
    while True:
        quote, comment = line.find('"', at), line.find('//', at)
        if quote < 0 or (0 <= comment < quote):
            return out
        m = LITERAL.match(line, quote)
        if not m:
            return out
        out.append(m.group(1))
        at = m.end()


def scan_names(root, layers):
    """Problems: string literals under a folder that name what a layer above
    owns ([unnamed])."""
    problems = []
    forbidden = forbidden_names(root, layers)
    for path in source_files(root, layers):
        names = forbidden.get(path.split('/')[0])
        if not names:
            continue
        with open(os.path.join(root, path), errors='replace') as f:
            for number, line in enumerate(f, 1):
                for literal in code_literals(line):
                    if literal in names:
                        problems.append('%s:%d: names "%s", which %s owns (tests/layering/layers.txt [unnamed])' % (
                            path, number, literal, names[literal]))
    return problems


def graph_lines(layers, edges):
    """The folder-level graph, top-level folders first, then each folder's
    parts bottom first: "name -> what it includes" ("!" marks an include
    the table forbids)."""
    def targets(label, same_top):
        out = []
        for (x, y), ok in sorted(edges.items()):
            if x == label and (y.split('/')[0] == label.split('/')[0]) == same_top:
                out.append(y + ('' if ok else ' !'))
        return out

    lines = ['top level (what each folder includes from the others):']
    for top in layers.order:
        seen = set()
        for (x, y), ok in sorted(edges.items()):
            if x.split('/')[0] == top and y.split('/')[0] != top:
                seen.add(y.split('/')[0] + ('' if verdict(layers, Unit(top), Unit(y.split('/')[0])) is None else ' !'))
        lines.append('  %-12s -> %s' % (top, ' '.join(sorted(seen)) or '(nothing internal)'))
    for folder, table in layers.parts.items():
        lines.append('%s/ (its parts, bottom first; each includes only earlier lines):' % folder)
        for names in table:
            for name in names:
                label = folder + '/' + name
                inside = [t[len(folder) + 1:] for t in targets(label, True)]
                lines.append('  %-22s -> %s' % (name, ' '.join(inside) or '-'))
    return lines


# --- self-test: the checker on scratch trees ---------------------------------

BAD_TREE = {
    'models/m.h': '#include "framework/fsdp/f.h"\n',            # up, across folders
    'comm/d.h': '#include "models/m.h"\n',                      # not below it
    'framework/fsdp/f.h': '#include "framework/dtensor/t.h"\n',  # fine
    'framework/dtensor/t.h': '#include "comm/d.h"\n',           # fine
    'framework/config/c.h': '#include "framework/train/t.h"\n',  # up, inside
    'framework/train/t.h': '#include "framework/config/c.h"\n',  # fine
    'framework/tp/p.h': '#include "framework/optim/o.h"\n',      # sideways
    'framework/optim/o.h': '',
    'checkpoint/storage/s.h': '#include "checkpoint/format/x.h"\n',  # up, inside
    'checkpoint/format/x.h': '#include "checkpoint/errors.h"\n',     # fine
    'checkpoint/errors.h': '',
    'checkpoint/errors.cpp': '#include "checkpoint/errors.h"\n',    # same part
    'checkpoint/newpart/n.h': '',                                   # unplaced
    'tools/t.cpp': '#include "framework/train/t.h"\n#include <vector>\n#include "zlib.h"\n',
    'framework/config/run_items.h': 'inline constexpr const char* kStepItem = "train.step";\n',
    'framework/config/schema.cpp': '{SHARDKIT_CONFIG_FIELD(model.kind)}, {SHARDKIT_CONFIG_FIELD(checkpoint.mode)}\n',
    'checkpoint/interop/x.cpp': 'a("train.step");\nb("model.kind");\nc("checkpoint.mode");  // "train.step"\n',
}
EXPECTED = [
    'models/m.h:1: models includes framework/fsdp',
    'comm/d.h:1: comm includes models',
    'framework/config/c.h:1: framework/config includes framework/train',
    'framework/tp/p.h:1: framework/tp includes framework/optim',
    'checkpoint/storage/s.h:1: checkpoint/storage includes checkpoint/format',
    'checkpoint/newpart/n.h: checkpoint/newpart/ is a folder',
    'checkpoint/interop/x.cpp:1: names "train.step"',
    'checkpoint/interop/x.cpp:2: names "model.kind"',
]


def self_test(layers):
    with tempfile.TemporaryDirectory() as root:
        for path, text in BAD_TREE.items():
            os.makedirs(os.path.join(root, os.path.dirname(path)), exist_ok=True)
            with open(os.path.join(root, path), 'w') as f:
                f.write(text)
        problems, _ = scan(root, layers)
        problems += scan_names(root, layers)
        missing = [e for e in EXPECTED if not any(p.startswith(e) for p in problems)]
        extra = [p for p in problems if not any(p.startswith(e) for e in EXPECTED)]
        if missing or extra:
            print('self-test FAILED: missing %s, unexpected %s' % (missing, extra))
            return False
        os.remove(os.path.join(root, 'checkpoint/newpart/n.h'))
        for path in ('models/m.h', 'comm/d.h', 'framework/config/c.h', 'framework/tp/p.h',
                     'checkpoint/storage/s.h', 'checkpoint/interop/x.cpp'):
            open(os.path.join(root, path), 'w').close()
        problems, _ = scan(root, layers)
        problems += scan_names(root, layers)
        if problems:
            print('self-test FAILED: a clean tree gave %s' % problems)
            return False
    print('self-test: the checker finds each kind of problem, and none in a clean tree')
    return True


def doc_matches(doc, lines):
    """Whether `doc` draws the graph the code has: its code block that starts
    with the graph's first line equals `lines`."""
    with open(doc, encoding='utf-8') as f:
        text = f.read()
    start = text.find('```\n' + lines[0] + '\n')
    if start < 0:
        print('%s: no code block starting with %r: draw the graph there (--graph)' % (doc, lines[0]))
        return False
    body = text[start + 4:text.find('```', start + 4)].rstrip('\n').split('\n')
    if body == lines:
        return True
    first = next(i for i in range(max(len(body), len(lines)))
                 if i >= len(body) or i >= len(lines) or body[i] != lines[i])
    line = text[:start].count('\n') + 2 + first
    print('%s:%d: the graph drawn differs from the code\'s (--graph prints it):' % (doc, line))
    print('  drawn: %s' % (body[first] if first < len(body) else '(nothing)'))
    print('  code:  %s' % (lines[first] if first < len(lines) else '(nothing)'))
    return False


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--root', default=os.path.dirname(os.path.dirname(HERE)),
                        help='the source tree (default: this checkout)')
    parser.add_argument('--layers', default=os.path.join(HERE, 'layers.txt'))
    parser.add_argument('--graph', action='store_true', help='print the folder-level graph')
    parser.add_argument('--self-test', action='store_true',
                        help='check the checker on scratch trees first')
    parser.add_argument('--doc', help='a Markdown file whose code block that starts with the '
                        "graph's first line must be the graph the code has (docs/architecture.md)")
    args = parser.parse_args()
    layers = Layers(args.layers)
    if args.self_test and not self_test(layers):
        return 1
    problems, edges = scan(args.root, layers)
    problems += scan_names(args.root, layers)
    if args.graph:
        print('\n'.join(graph_lines(layers, edges)))
    for p in problems:
        print(p)
    if problems:
        print('%d include(s) or name(s) break the layering of %s' % (len(problems), args.layers))
        return 1
    if args.doc and not doc_matches(args.doc, graph_lines(layers, edges)):
        return 1
    print('layering: every include goes down (%d folder edges)' % len(edges))
    return 0


if __name__ == '__main__':
    sys.exit(main())
