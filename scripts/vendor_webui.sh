#!/usr/bin/env bash
# Refresh the web page's vendored libraries (src/tianxia/server/webui/vendor/) from npm.
# Not part of installing or testing: the files it writes are committed, so the page needs no
# build step and no network. Run it to move to new versions, then check the page's tests pass.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=src/tianxia/server/webui/vendor
MARKED=marked@18.2.1
DOMPURIFY=dompurify@3.5.0
PRISM=prismjs@1.30.0
TEMML=temml@0.13.5
# Prism languages, each after the ones it extends (components.json's "require")
PRISM_LANGS="markup css clike javascript typescript c cpp python bash json yaml toml rust go java sql diff markdown"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for pkg in "$MARKED" "$DOMPURIFY" "$PRISM" "$TEMML"; do
    name=${pkg%@*}
    mkdir -p "$work/$name"
    (cd "$work" && npm pack -q "$pkg" >/dev/null)
    tar xzf "$work"/"$name"-*.tgz -C "$work/$name" --strip-components=1
done
mkdir -p "$OUT"
cp "$work/marked/lib/marked.umd.js" "$OUT/marked.umd.js"
cp "$work/marked/LICENSE" "$OUT/marked.LICENSE"
cp "$work/dompurify/dist/purify.min.js" "$OUT/purify.min.js"
cp "$work/dompurify/LICENSE" "$OUT/dompurify.LICENSE"   # dual MPL-2.0 / Apache-2.0: Apache-2.0
{
    echo "/* $PRISM: prism-core + $PRISM_LANGS (components/*.min.js, concatenated) */"
    cat "$work/prismjs/components/prism-core.min.js"; echo
    for lang in $PRISM_LANGS; do cat "$work/prismjs/components/prism-$lang.min.js"; echo; done
} > "$OUT/prism.min.js"
cp "$work/prismjs/LICENSE" "$OUT/prism.LICENSE"
cp "$work/temml/dist/temml.min.js" "$OUT/temml.min.js"
cp "$work/temml/LICENSE" "$OUT/temml.LICENSE"
{
    echo "Vendored by scripts/vendor_webui.sh from npm; each file keeps its own licence:"
    echo "  marked.umd.js     $MARKED (MIT, marked.LICENSE)"
    echo "  purify.min.js     $DOMPURIFY (Apache-2.0 or MPL-2.0, dompurify.LICENSE)"
    echo "  prism.min.js      $PRISM (MIT, prism.LICENSE): core + $PRISM_LANGS"
    echo "  temml.min.js      $TEMML (MIT, temml.LICENSE), loaded only when a reply has math"
} > "$OUT/README"
ls -l "$OUT"
