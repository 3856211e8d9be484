// A data table: a thin Preact wrapper around Tabulator (which renders, sorts, filters,
// paginates and virtualises the rows; this only hands it the rows). Updates keep the
// user's page, sort and filters: rows are matched by `index` (the id field).
import { html } from "htm/preact";
import { useEffect, useRef } from "preact/hooks";
import { TabulatorFull as Tabulator } from "tabulator-tables";

// props: columns (Tabulator column definitions), data, index, options, onReady(table), testid
export function Table({ columns, data, index = "id", options = {}, onReady, testid }) {
  const box = useRef(null);
  const table = useRef(null);
  const ready = useRef(false);
  const pending = useRef(null);

  useEffect(() => {
    const t = new Tabulator(box.current, {
      data: [],
      index,
      columns,
      layout: "fitColumns",
      reactiveData: false,
      placeholder: "nothing here",
      ...options,
    });
    t.on("tableBuilt", () => {
      ready.current = true;
      if (pending.current) {
        t.replaceData(pending.current);
        pending.current = null;
      }
      if (onReady) onReady(t);
    });
    table.current = t;
    return () => {
      ready.current = false;
      t.destroy();
      table.current = null;
    };
  }, []);

  useEffect(() => {
    const t = table.current;
    if (!t) return;
    if (!ready.current) {
      pending.current = data;
      return;
    }
    // replaceData keeps sort, filters and the current page; rows gone are removed
    t.replaceData(data);
  }, [data]);

  return html`<div class="table" data-testid=${testid} ref=${box}></div>`;
}
