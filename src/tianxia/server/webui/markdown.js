// Model output to safe HTML: Markdown (marked), sanitized (DOMPurify), code blocks highlighted
// (Prism) with a copy button, LaTeX as MathML (Temml, fetched the first time a reply has math).
// Raw HTML in the output is shown as text, as chat pages do.

/* global marked, DOMPurify, Prism */

export function escapeHtml(s) {
  return String(s)
    .replace(/&/g, "&amp;")
    .replace(/</g, "&lt;")
    .replace(/>/g, "&gt;")
    .replace(/"/g, "&quot;")
    .replace(/'/g, "&#39;");
}

function codeBlock(text, lang, label) {
  const cls = lang ? ` class="language-${escapeHtml(lang)}"` : "";
  return (
    `<div class="code-block"><div class="code-head"><span>${escapeHtml(label || lang || "text")}` +
    `</span><button type="button" class="copy-code" aria-label="Copy code">Copy</button></div>` +
    `<pre><code${cls}>${escapeHtml(text)}</code></pre></div>`
  );
}

function math(tex, display) {
  const tag = display ? "div" : "span";
  return `<${tag} class="math" data-display="${display ? 1 : 0}" data-tex="${escapeHtml(tex)}">` +
    `${escapeHtml(tex)}</${tag}>`;
}

// $$...$$ and \[...\] on their own lines; \(...\) and $...$ inline (an opening `$` before a
// non-space, a closing one after a non-space and not before a digit, so "$5 and $10" stays text)
const mathExtensions = [
  {
    name: "mathBlock",
    level: "block",
    start(src) {
      const i = src.search(/\$\$|\\\[/);
      return i < 0 ? undefined : i;
    },
    tokenizer(src) {
      const m = /^(?:\$\$([\s\S]+?)\$\$|\\\[([\s\S]+?)\\\])[ \t]*(?:\n|$)/.exec(src);
      if (m) return { type: "mathBlock", raw: m[0], text: (m[1] ?? m[2]).trim() };
      return undefined;
    },
    renderer: (token) => math(token.text, true),
  },
  {
    name: "mathInline",
    level: "inline",
    start(src) {
      const i = src.search(/\$|\\\(/);
      return i < 0 ? undefined : i;
    },
    tokenizer(src) {
      const m =
        /^\$\$([^$]+?)\$\$/.exec(src) ||
        /^\\\(([\s\S]+?)\\\)/.exec(src) ||
        /^\$(?=\S)([^$\n]*?\S)\$(?!\d)/.exec(src);
      if (m) return { type: "mathInline", raw: m[0], text: m[1] };
      return undefined;
    },
    renderer: (token) => math(token.text, false),
  },
];

let parser = null;

function markdownParser() {
  if (!parser) {
    parser = new marked.Marked({ gfm: true, breaks: false });
    parser.use({
      extensions: mathExtensions,
      renderer: {
        code: ({ text, lang }) => codeBlock(text, (lang || "").split(/\s/)[0]),
        html: ({ text }) => escapeHtml(text),
      },
    });
  }
  return parser;
}

/** Sanitized HTML for Markdown `text`. */
export function renderMarkdown(text) {
  const html = markdownParser().parse(text);
  return DOMPurify.sanitize(html); // keeps data-* and aria-* attributes by default
}

/** A block of JSON, pretty-printed when it parses (JSON-schema replies, tool-call arguments). */
export function renderJson(text, label) {
  let shown = text;
  try {
    shown = JSON.stringify(JSON.parse(text), null, 2);
  } catch {
    // still streaming, or not JSON after all: show it as it is
  }
  return codeBlock(shown, "json", label);
}

let temml = null;

function loadTemml() {
  if (!temml) {
    temml = new Promise((resolve, reject) => {
      const script = document.createElement("script");
      script.src = "webui/vendor/temml.min.js";
      script.onload = () => resolve(window.temml);
      script.onerror = () => reject(new Error("could not load the math renderer"));
      document.head.append(script);
    });
  }
  return temml;
}

function renderMath(el, lib) {
  try {
    lib.render(el.dataset.tex, el, { displayMode: el.dataset.display === "1", throwOnError: false });
    el.classList.add("rendered");
  } catch {
    // leave the TeX source visible
  }
}

/** Highlight the code blocks in `root` and render its math. */
export function enhance(root) {
  for (const code of root.querySelectorAll("pre code[class*='language-']")) {
    const lang = code.className.replace(/.*language-(\S+).*/, "$1");
    if (Prism.languages[lang]) Prism.highlightElement(code);
  }
  const maths = root.querySelectorAll(".math[data-tex]:not(.rendered)");
  if (maths.length) {
    loadTemml().then(
      (lib) => maths.forEach((el) => el.isConnected && renderMath(el, lib)),
      () => {},
    );
  }
}

/** Copy `text` to the clipboard (the Clipboard API needs a secure context; else execCommand). */
export async function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) {
    await navigator.clipboard.writeText(text);
    return;
  }
  const area = document.createElement("textarea");
  area.value = text;
  area.setAttribute("readonly", "");
  area.style.position = "fixed";
  area.style.opacity = "0";
  document.body.append(area);
  area.select();
  document.execCommand("copy");
  area.remove();
}
