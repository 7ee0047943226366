"""Prompt data, in the order it flows: `sources` reads the rows `data.path` names (files, directories, hub
names), `prompts` turns them into tokenized `Prompt`s (the prompt column or template, the chat template, what the
reward sees), and `stream` hands them out epoch after epoch by ticket, resumably (`PromptStream`)."""
