"""Where a config's prompts come from: the files bundled here (``unirl://NAME``, listed by ``unirl data
list``), sources generated in code (``unirl://ocr/generated?n=...``), and paths found from the working
directory or beside the config file.

By job: ``paths.py`` (a data value -> a file or generated rows; the generated sources' registry) and
``ocr_prompts.py`` (the OCR prompts made in code). The folders beside them hold the bundled prompt sets
with their licences (``README.md``).
"""
