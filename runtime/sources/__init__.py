"""Where a bundle comes from and whether its files hold: a directory (:mod:`.bundle`, with
:mod:`.opened` for the opened bundle and :mod:`.file_kinds` for what each file must be), an
archive (:mod:`.archive`), an installed wheel (:mod:`.installed`), a model hub (:mod:`.hub`),
and the cache folders (:mod:`.paths`).
"""
