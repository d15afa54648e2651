// A light highlighter for what a code model writes most (Python, JavaScript, shell, Rust): comments, strings,
// numbers, decorators and keywords. Anything it does not know stays plain text.

import { escapeHtml } from "./common.js";

const TOKENS = new RegExp([
  String.raw`(#[^\n]*|\/\/[^\n]*)`,
  String.raw`("""[\s\S]*?(?:"""|$)|'''[\s\S]*?(?:'''|$)|"(?:\\.|[^"\\\n])*"?|'(?:\\.|[^'\\\n])*'?)`,
  String.raw`\b(\d+(?:\.\d+)?)\b`,
  String.raw`(@[\w.]+)`,
  String.raw`\b(def|class|return|if|elif|else|for|while|in|not|and|or|is|None|True|False|import|from|as|with|try|except|finally|raise|yield|lambda|pass|break|continue|async|await|self|const|let|var|function|new|this|null|undefined|true|false|fn|pub|impl|struct|use|mut|match)\b`,
].join("|"), "g");
const KINDS = ["c", "s", "n", "d", "k"];

export function highlight(code) {
  let out = "";
  let last = 0;
  for (const m of code.matchAll(TOKENS)) {
    out += escapeHtml(code.slice(last, m.index));
    const kind = KINDS[m.slice(1).findIndex((g) => g !== undefined)];
    out += `<span class="tok-${kind}">${escapeHtml(m[0])}</span>`;
    last = m.index + m[0].length;
  }
  return out + escapeHtml(code.slice(last));
}
