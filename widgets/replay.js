// Standalone replay: a model that holds recorded frames instead of talking to a kernel, so an exported HTML
// file plays with no kernel and no network. It implements what the views use of an anywidget model.

class KvReplayModel {
  constructor(frames, state = {}) {
    this.state = { frame: frames[frames.length - 1], frames_sent: frames.length, ...state };
    this.frames = frames;
    this.handlers = {};
  }
  get(key) { return this.state[key]; }
  set(key, value) { this.state[key] = value; }
  save_changes() {}
  on(event, fn) { (this.handlers[event] = this.handlers[event] || []).push(fn); }
  off(event, fn) { this.handlers[event] = (this.handlers[event] || []).filter((h) => h !== fn); }
  // "ready" is answered with the whole recording as history, shown at its last frame (the end of the run, as
  // in the notebook); other messages need a kernel and are ignored.
  send(msg) {
    if (msg.type === "ready") {
      for (const fn of this.handlers["msg:custom"] || []) fn({ type: "history", reset: true }, this.frames);
    }
  }
}

function kvBase64(s) {
  const bin = atob(s), out = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
  return out;
}

// Mount `render` on `el` with the frames (base64 strings) of a recording; returns the model.
function kvReplay(el, framesB64, render) {
  const frames = framesB64.map(kvBase64);
  const model = new KvReplayModel(frames);
  render({ model, el });
  return model;
}
