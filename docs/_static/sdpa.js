/* Line-break opportunities in long dotted API names, registered in conf.py.
 *
 * Names such as sdpa_array.testing.bounds.vjp_oracle_and_bounds contain no break
 * opportunity, so a narrow column either overflows or, with overflow-wrap, breaks them
 * anywhere ("...attenti|on"). This adds <wbr> after each "." and "_" of the page title, of
 * the navigation links (sidebars, breadcrumbs, previous/next) and of the code in the
 * summaries of autosummary tables, so that they wrap at a name boundary first. In the title, the
 * breaks after "_" have the class "sdpa-wbr-narrow", which sdpa.css disables on wide
 * screens: there a title wraps only after a ".". Only text nodes are split: links, anchors,
 * copied text and search are unchanged.
 */
(function () {
  "use strict";

  const SPLIT = /(?<=[._])(?=.)/;

  function addBreaks(selector, underscoreClass) {
    for (const root of document.querySelectorAll(selector)) {
      const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
      const texts = [];
      for (let node = walker.nextNode(); node; node = walker.nextNode()) {
        if (SPLIT.test(node.data)) texts.push(node);
      }
      for (const node of texts) {
        const fragment = document.createDocumentFragment();
        const pieces = node.data.split(SPLIT);
        pieces.forEach(function (piece, i) {
          fragment.appendChild(document.createTextNode(piece));
          if (i === pieces.length - 1) return;
          const wbr = document.createElement("wbr");
          if (underscoreClass && piece.endsWith("_")) wbr.className = underscoreClass;
          fragment.appendChild(wbr);
        });
        node.replaceWith(fragment);
      }
    }
  }

  function run() {
    addBreaks(".bd-article h1", "sdpa-wbr-narrow");
    addBreaks(
      ".bd-sidebar-primary nav a, .bd-sidebar-secondary nav a, .bd-breadcrumbs li, " +
        ".bd-article table.autosummary td:last-child code, .prev-next-area .prev-next-title"
    );
  }

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", run);
  } else {
    run();
  }
})();
