// Conversations kept in this browser (localStorage), so a reload lists them and goes
// on with any: each message keeps the response id the server stored it under, and a
// new turn continues from the last one with previous_response_id.

const STORE_NAME = "sluice.conversations";

export function loadConversations() {
  try {
    const kept = JSON.parse(localStorage.getItem(STORE_NAME) || "[]");
    return Array.isArray(kept) ? kept : [];
  } catch {
    return [];
  }
}

export function saveConversations(conversations) {
  localStorage.setItem(STORE_NAME, JSON.stringify(conversations));
}

export function newConversation() {
  const id = `c${Date.now().toString(36)}${Math.random().toString(36).slice(2, 6)}`;
  return { id, title: "New chat", created: Date.now(), messages: [] };
}

// The response a new turn continues from: the last one the server stored.
export function lastResponseId(conversation) {
  for (let i = conversation.messages.length - 1; i >= 0; i -= 1) {
    const id = conversation.messages[i].responseId;
    if (id) return id;
  }
  return null;
}
