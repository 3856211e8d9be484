// Poll a loader every `ms` while the page is visible; returns [data, error, reload].
import { useCallback, useEffect, useRef, useState } from "preact/hooks";

export function usePoll(load, ms, deps = []) {
  const [data, setData] = useState(null);
  const [error, setError] = useState(null);
  const alive = useRef(true);
  const tick = useCallback(async () => {
    try {
      const d = await load();
      if (alive.current) {
        setData(d);
        setError(null);
      }
    } catch (e) {
      if (alive.current) setError(e);
    }
  }, deps);
  useEffect(() => {
    alive.current = true;
    tick();
    const timer = setInterval(() => {
      if (document.visibilityState === "visible") tick();
    }, ms);
    return () => {
      alive.current = false;
      clearInterval(timer);
    };
  }, [tick, ms]);
  return [data, error, tick];
}
