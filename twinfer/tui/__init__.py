"""`twinfer chat`: the Textual chat app (app.py), its one view of a model (backend.py), prompts
(prompt.py), conversations (conversation.py), widgets, dialogs, and the README screenshot."""
