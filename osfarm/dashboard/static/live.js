// The desktop page: JPEG frames from a WebSocket drawn on a canvas scaled to the window, and,
// for an admin who takes control, mouse and keyboard sent back as computer_13 actions.
// The server captures frames only while this socket is open.
"use strict";

const KEYS = {
  Enter: "enter", Backspace: "backspace", Tab: "tab", Escape: "esc", Delete: "delete", Insert: "insert",
  ArrowUp: "up", ArrowDown: "down", ArrowLeft: "left", ArrowRight: "right", Home: "home", End: "end",
  PageUp: "pageup", PageDown: "pagedown", CapsLock: "capslock", " ": "space", ContextMenu: "apps",
  PrintScreen: "printscreen", Pause: "pause", ScrollLock: "scrolllock", NumLock: "numlock",
};
for (let i = 1; i <= 24; i++) KEYS["F" + i] = "f" + i;
const MODIFIERS = new Set(["Control", "Shift", "Alt", "Meta", "AltGraph", "OS", "Hyper", "Super"]);
const BUTTONS = ["left", "middle", "right"];

document.addEventListener("DOMContentLoaded", () => {
  const canvas = document.getElementById("screen");
  const ctx = canvas.getContext("2d");
  const stateEl = document.getElementById("live-state");
  const fpsEl = document.getElementById("live-fps");
  const button = document.getElementById("take-control");
  const controlEl = document.getElementById("live-control");
  let ws = null, screen = {width: 0, height: 0}, controlling = false, frames = 0, lastCount = 0;
  let queue = [], flushTimer = null, closed = false;
  canvas.dataset.frames = "0";

  function fit() {
    if (!screen.width) return;
    const bar = document.querySelector(".live-bar");
    const maxW = window.innerWidth - 16;
    const maxH = window.innerHeight - (bar ? bar.getBoundingClientRect().bottom : 0) - 16;
    const s = Math.min(maxW / screen.width, Math.max(120, maxH) / screen.height, 1);
    canvas.style.width = Math.round(screen.width * s) + "px";
    canvas.style.height = Math.round(screen.height * s) + "px";
    send({type: "view", width: Math.round(screen.width * s * devicePixelRatio),
          height: Math.round(screen.height * s * devicePixelRatio)});
  }

  function send(msg) {
    if (ws && ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify(msg));
  }

  function connect() {
    const url = new URL(canvas.dataset.ws, window.location.href);
    url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
    ws = new WebSocket(url);
    ws.binaryType = "blob";
    ws.onopen = () => { stateEl.textContent = "live"; };
    ws.onmessage = async ev => {
      if (typeof ev.data !== "string") {
        const bmp = await createImageBitmap(ev.data);
        if (canvas.width !== bmp.width || canvas.height !== bmp.height) {
          canvas.width = bmp.width; canvas.height = bmp.height;
        }
        ctx.drawImage(bmp, 0, 0);
        bmp.close();
        frames++;
        canvas.dataset.frames = String(frames);
        return;
      }
      const m = JSON.parse(ev.data);
      if (m.type === "hello") {
        screen = m.screen;
        fit();
        if (button) button.disabled = !m.can_control;
        if (button && !m.can_control) button.title = m.why || "";
      } else if (m.type === "control") {
        controlling = m.on && m.mine;
        canvas.classList.toggle("controlling", controlling);
        controlEl.hidden = !m.on;
        controlEl.textContent = m.on ? "controlled by " + m.by : "";
        if (button) button.textContent = controlling ? "Release control" : "Take control";
        if (controlling) canvas.focus();
      } else if (m.type === "state") {
        stateEl.textContent = m.text;
      } else if (m.type === "error") {
        stateEl.textContent = m.detail;
      }
    };
    ws.onclose = ev => {
      controlling = false;
      canvas.classList.remove("controlling");
      stateEl.textContent = ev.reason || "disconnected";
      if (!closed && ev.code !== 4401 && ev.code !== 4403 && ev.code !== 4404) setTimeout(connect, 1500);
    };
  }

  setInterval(() => { fpsEl.textContent = (frames - lastCount) + " fps"; lastCount = frames; }, 1000);
  window.addEventListener("resize", fit);
  window.addEventListener("beforeunload", () => { closed = true; if (ws) ws.close(); });

  if (button) button.addEventListener("click", () => {
    send({type: "control", on: !controlling, csrf: canvas.dataset.csrf});
  });

  // -- input, only while in control ------------------------------------------------------------
  function point(ev) {
    const r = canvas.getBoundingClientRect();
    const x = Math.round((ev.clientX - r.left) / r.width * screen.width);
    const y = Math.round((ev.clientY - r.top) / r.height * screen.height);
    return {x: Math.max(0, Math.min(screen.width - 1, x)), y: Math.max(0, Math.min(screen.height - 1, y))};
  }
  function push(action) {
    const last = queue[queue.length - 1];
    if (action.action_type === "MOVE_TO" && last && last.action_type === "MOVE_TO") queue[queue.length - 1] = action;
    else queue.push(action);
    if (!flushTimer) flushTimer = setTimeout(flush, 25);
  }
  function flush() {
    flushTimer = null;
    if (queue.length) send({type: "input", actions: queue});
    queue = [];
  }
  function move(ev) { return {action_type: "MOVE_TO", parameters: point(ev)}; }

  canvas.addEventListener("mousemove", ev => { if (controlling) push(move(ev)); });
  canvas.addEventListener("mousedown", ev => {
    if (!controlling) return;
    ev.preventDefault(); canvas.focus();
    push(move(ev));
    push({action_type: "MOUSE_DOWN", parameters: {button: BUTTONS[ev.button] || "left"}});
  });
  canvas.addEventListener("mouseup", ev => {
    if (!controlling) return;
    ev.preventDefault();
    push(move(ev));
    push({action_type: "MOUSE_UP", parameters: {button: BUTTONS[ev.button] || "left"}});
  });
  canvas.addEventListener("contextmenu", ev => { if (controlling) ev.preventDefault(); });
  canvas.addEventListener("wheel", ev => {
    if (!controlling) return;
    ev.preventDefault();
    const clicks = Math.max(1, Math.round(Math.abs(ev.deltaY) / 100));
    push(move(ev));
    push({action_type: "SCROLL", parameters: {dx: 0, dy: ev.deltaY < 0 ? clicks : -clicks}});
  }, {passive: false});
  canvas.addEventListener("keydown", ev => {
    if (!controlling || MODIFIERS.has(ev.key)) return;
    ev.preventDefault();
    const printable = ev.key.length === 1;
    if (printable && !ev.ctrlKey && !ev.altKey && !ev.metaKey) {
      const last = queue[queue.length - 1];
      if (last && last.action_type === "TYPING") last.parameters.text += ev.key;
      else push({action_type: "TYPING", parameters: {text: ev.key}});
      return;
    }
    const name = KEYS[ev.key] || (printable ? ev.key.toLowerCase() : null);
    if (!name) return;
    const mods = [];
    if (ev.ctrlKey) mods.push("ctrl");
    if (ev.altKey) mods.push("alt");
    if (ev.shiftKey && !printable) mods.push("shift");
    if (ev.metaKey) mods.push("win");
    push(mods.length ? {action_type: "HOTKEY", parameters: {keys: mods.concat([name])}}
                     : {action_type: "PRESS", parameters: {key: name}});
  });

  connect();
});
