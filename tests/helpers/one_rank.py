"""The strategy calls the folder-checkpoint helpers (``saved_beside``, ``recover_folder_on_rank_zero``) make, on one
process."""


class OneRank:
    """Rank 0 of a world of one: ``broadcast`` returns its object, ``barrier`` returns at once."""

    global_rank = 0

    def broadcast(self, obj):
        return obj

    def barrier(self, name=None):
        pass
