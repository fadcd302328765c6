// Markdown to DOM nodes, safely: every piece of the model's text becomes a text node
// (never markup), and links are kept only for http(s) and mailto addresses. Handles
// what chat replies use: fenced code, headings, lists, quotes, paragraphs, and inline
// code, bold, italic and links. An unclosed fence (text still streaming) is code.

const SAFE_LINK = /^(https?:|mailto:)/i;
// Underscores emphasise only between word boundaries (CommonMark's rule), so
// snake_case names and window.__name stay as written.
const INLINE = /(`+)([^`]|[^`][\s\S]*?[^`])\1|\*\*([^*]+)\*\*|(?<!\w)__(?!\s)([^_]+?)(?<!\s)__(?!\w)|\*([^*\s][^*]*)\*|(?<!\w)_(?!\s)([^_]+?)(?<!\s)_(?!\w)|\[([^\]]+)\]\(([^)\s]+)\)/g;

function element(tag, className) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  return node;
}

function appendInline(parent, text) {
  let last = 0;
  for (const match of text.matchAll(INLINE)) {
    if (match.index > last) parent.append(text.slice(last, match.index));
    last = match.index + match[0].length;
    const [, , code, bold1, bold2, em1, em2, label, href] = match;
    if (code !== undefined) {
      const node = element("code");
      node.textContent = code;
      parent.append(node);
    } else if (bold1 !== undefined || bold2 !== undefined) {
      const node = element("strong");
      appendInline(node, bold1 ?? bold2);
      parent.append(node);
    } else if (em1 !== undefined || em2 !== undefined) {
      const node = element("em");
      appendInline(node, em1 ?? em2);
      parent.append(node);
    } else if (SAFE_LINK.test(href)) {
      const node = element("a");
      node.href = href;
      node.rel = "noopener noreferrer nofollow";
      node.target = "_blank";
      appendInline(node, label);
      parent.append(node);
    } else {
      parent.append(match[0]);
    }
  }
  if (last < text.length) parent.append(text.slice(last));
}

function appendLines(parent, lines) {
  lines.forEach((line, i) => {
    if (i > 0) parent.append(element("br"));
    appendInline(parent, line);
  });
}

const LIST_ITEM = /^\s*([-*+]|\d+[.)])\s+(.*)$/;

export function renderMarkdown(text) {
  const root = document.createDocumentFragment();
  const lines = text.split("\n");
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = /^\s*(```|~~~)\s*([\w+-]*)/.exec(line);
    if (fence) {
      const body = [];
      i += 1;
      while (i < lines.length && !lines[i].trim().startsWith(fence[1])) body.push(lines[i++]);
      i += 1; // the closing fence (or the end of the text)
      const pre = element("pre");
      const code = element("code");
      if (fence[2]) code.dataset.language = fence[2];
      code.textContent = body.join("\n");
      pre.append(code);
      root.append(pre);
      continue;
    }
    const heading = /^(#{1,6})\s+(.*)$/.exec(line);
    if (heading) {
      const node = element(`h${Math.min(heading[1].length + 2, 6)}`);
      appendInline(node, heading[2]);
      root.append(node);
      i += 1;
      continue;
    }
    const item = LIST_ITEM.exec(line);
    if (item) {
      const list = element(/\d/.test(item[1]) ? "ol" : "ul");
      const start = parseInt(item[1], 10);
      if (start > 1) list.start = start; // "2." after a paragraph goes on counting
      let next;
      while (i < lines.length && (next = LIST_ITEM.exec(lines[i]))) {
        const li = element("li");
        appendInline(li, next[2]);
        list.append(li);
        i += 1;
      }
      root.append(list);
      continue;
    }
    if (line.startsWith(">")) {
      const quoted = [];
      while (i < lines.length && lines[i].startsWith(">")) quoted.push(lines[i++].replace(/^>\s?/, ""));
      const quote = element("blockquote");
      appendLines(quote, quoted);
      root.append(quote);
      continue;
    }
    if (!line.trim()) {
      i += 1;
      continue;
    }
    const paragraph = [];
    while (i < lines.length && lines[i].trim() && !startsBlock(lines[i])) paragraph.push(lines[i++]);
    const p = element("p");
    appendLines(p, paragraph);
    root.append(p);
  }
  return root;
}

function startsBlock(line) {
  return /^\s*(```|~~~)/.test(line) || /^#{1,6}\s/.test(line) || LIST_ITEM.test(line) || line.startsWith(">");
}
