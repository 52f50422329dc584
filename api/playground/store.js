// Conversations, kept in this browser's localStorage (they never leave it).

const STORE = "playground.conversations";
const CURRENT = "playground.current";
const MAX_CONVERSATIONS = 50;

export function loadConversations() {
  try {
    const list = JSON.parse(localStorage.getItem(STORE) || "[]");
    return Array.isArray(list) ? list : [];
  } catch (_) {
    return [];  // a damaged entry: start over rather than fail
  }
}

export function saveConversations(list, current) {
  const kept = list.slice(0, MAX_CONVERSATIONS);
  localStorage.setItem(CURRENT, current);
  try {
    localStorage.setItem(STORE, JSON.stringify(kept));
  } catch (_) {
    // over the quota: the per-token data is what takes room, so keep the texts only
    const texts = kept.map((c) => ({ ...c, messages: c.messages.map(({ tokens, ...m }) => m) }));
    localStorage.setItem(STORE, JSON.stringify(texts));
  }
}

export function savedCurrent() {
  return localStorage.getItem(CURRENT);
}

export function newConversation() {
  const id = `${Date.now().toString(36)}-${Math.random().toString(36).slice(2, 8)}`;
  return { id, title: "", messages: [], updated: Date.now() };
}
