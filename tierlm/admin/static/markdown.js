// A small, safe markdown renderer for the chat page: the text is HTML-escaped
// first, then fenced code blocks (highlighted), inline code, headings, lists,
// quotes, bold / italic and links (http, https, mailto and relative only) are
// made from the escaped text. Nothing the model writes can become markup of
// its own. An unclosed fence (an answer still streaming) is shown as code.
"use strict";

const TierMD = (() => {
  const escapeHTML = (s) => s.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
    .replace(/"/g, "&quot;").replace(/'/g, "&#39;");

  const KEYWORDS = new Set((
    "and as assert async await break case catch class const continue def default del do elif else enum " +
    "except export extends false finally fn for from func function go if impl import in interface is " +
    "lambda let loop match mod mut new nil none None not null or package pass pub raise return self " +
    "static struct super switch this throw true True False try type typeof use var void while with " +
    "yield int float str bool char long double unsigned signed string select insert update delete where " +
    "join create table values into echo then fi done esac local println printf print include define"
  ).split(" "));
  const HASH_COMMENT = new Set(["python", "py", "bash", "sh", "shell", "zsh", "ruby", "rb", "yaml", "yml",
    "toml", "perl", "r", "dockerfile", "makefile", "ini", "conf"]);
  const DASH_COMMENT = new Set(["sql", "lua", "haskell", "hs"]);

  // one pass of a tokenizer: comments, strings, numbers, words; everything escaped
  function highlight(code, lang) {
    lang = (lang || "").toLowerCase();
    const comment = HASH_COMMENT.has(lang) ? "#[^\\n]*" : DASH_COMMENT.has(lang) ? "--[^\\n]*"
      : "\\/\\/[^\\n]*|\\/\\*[\\s\\S]*?(?:\\*\\/|$)";
    const rx = new RegExp("(" + comment + ")|(\"(?:[^\"\\\\\\n]|\\\\.)*\"?|'(?:[^'\\\\\\n]|\\\\.)*'?|`[^`]*`?)" +
      "|(\\b\\d[\\d_]*(?:\\.\\d+)?(?:[eE][+-]?\\d+)?\\b|\\b0x[0-9a-fA-F]+\\b)|([A-Za-z_][A-Za-z0-9_]*)", "g");
    let out = "", last = 0, m;
    while ((m = rx.exec(code)) !== null) {
      if (m[0] === "") { rx.lastIndex++; continue; }
      out += escapeHTML(code.slice(last, m.index));
      const text = escapeHTML(m[0]);
      if (m[1]) out += '<span class="tok-comment">' + text + "</span>";
      else if (m[2]) out += '<span class="tok-string">' + text + "</span>";
      else if (m[3]) out += '<span class="tok-number">' + text + "</span>";
      else if (KEYWORDS.has(m[4])) out += '<span class="tok-keyword">' + text + "</span>";
      else out += text;
      last = m.index + m[0].length;
    }
    return out + escapeHTML(code.slice(last));
  }

  function safeURL(url) {
    // url is already escaped text; decode the entities to judge the scheme
    const raw = url.replace(/&amp;/g, "&").replace(/&#39;/g, "'").replace(/&quot;/g, '"').trim();
    const scheme = raw.match(/^([A-Za-z][A-Za-z0-9+.-]*):/);
    if (scheme && !["http", "https", "mailto"].includes(scheme[1].toLowerCase())) return null;
    if (/[\u0000-\u001f\s]/.test(raw)) return null;
    return url;
  }

  // inline markup of one escaped line: code spans are set aside first
  function inline(text) {
    const codes = [];
    text = text.replace(/`([^`]+)`/g, (_, c) => { codes.push(c); return "\u0000" + (codes.length - 1) + "\u0000"; });
    text = text.replace(/\[([^\]]+)\]\(([^)\s]+)\)/g, (all, label, url) => {
      const safe = safeURL(url);
      return safe === null ? label : '<a href="' + safe + '" target="_blank" rel="noopener noreferrer">' + label + "</a>";
    });
    text = text.replace(/\*\*(?=\S)([^*]+?)\*\*|__(?=\S)([^_]+?)__/g, (_, a, b) => "<strong>" + (a || b) + "</strong>");
    text = text.replace(/(^|[^*\w])\*(?=\S)([^*]+?)\*(?!\*)|(^|[^_\w])_(?=\S)([^_]+?)_(?!\w)/g,
      (_, p1, a, p2, b) => (p1 || p2 || "") + "<em>" + (a || b) + "</em>");
    return text.replace(/\u0000(\d+)\u0000/g, (_, i) => "<code>" + codes[+i] + "</code>");
  }

  function render(source) {
    const lines = source.replace(/\r\n?/g, "\n").split("\n");
    const out = [];
    let para = [], list = null; // list: {tag, items}
    const flushPara = () => { if (para.length) { out.push("<p>" + para.map((l) => inline(escapeHTML(l))).join("<br>") + "</p>"); para = []; } };
    const flushList = () => {
      if (list) { out.push("<" + list.tag + ">" + list.items.map((i) => "<li>" + inline(escapeHTML(i)) + "</li>").join("") + "</" + list.tag + ">"); list = null; }
    };
    for (let i = 0; i < lines.length; i++) {
      const line = lines[i];
      const fence = line.match(/^\s*(```+|~~~+)\s*([\w+#.-]*)/);
      if (fence) {
        flushPara(); flushList();
        const body = [];
        let j = i + 1;
        while (j < lines.length && !lines[j].trim().startsWith(fence[1])) body.push(lines[j++]);
        const lang = fence[2] || "";
        out.push('<pre class="code"><div class="code-lang">' + escapeHTML(lang || "code") + "</div><code>" +
          highlight(body.join("\n"), lang) + "</code></pre>");
        i = j;
        continue;
      }
      let m;
      if ((m = line.match(/^(#{1,6})\s+(.*)$/))) {
        flushPara(); flushList();
        const n = Math.min(m[1].length + 2, 6); // h3..h6: the page has its own h1, h2
        out.push("<h" + n + ">" + inline(escapeHTML(m[2])) + "</h" + n + ">");
      } else if ((m = line.match(/^\s*[-*+]\s+(.*)$/)) && !/^\s*([-*_])\s*\1\s*\1[\s\-*_]*$/.test(line)) {
        flushPara();
        if (!list || list.tag !== "ul") { flushList(); list = { tag: "ul", items: [] }; }
        list.items.push(m[1]);
      } else if ((m = line.match(/^\s*\d+[.)]\s+(.*)$/))) {
        flushPara();
        if (!list || list.tag !== "ol") { flushList(); list = { tag: "ol", items: [] }; }
        list.items.push(m[1]);
      } else if (/^\s*([-*_])\s*\1\s*\1[\s\-*_]*$/.test(line)) {
        flushPara(); flushList(); out.push("<hr>");
      } else if ((m = line.match(/^\s*>\s?(.*)$/))) {
        flushPara(); flushList();
        out.push("<blockquote>" + inline(escapeHTML(m[1])) + "</blockquote>");
      } else if (!line.trim()) {
        flushPara(); flushList();
      } else {
        flushList();
        para.push(line);
      }
    }
    flushPara(); flushList();
    return out.join("\n");
  }

  return { render, highlight, escapeHTML };
})();
